"""Faster implementations of the model's hot ops, each checked against the plain torch op it replaces."""
