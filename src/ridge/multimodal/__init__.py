"""Images in prompts: loading and preprocessing them (images.py), and placing them in a token prompt (placement.py).
"""
