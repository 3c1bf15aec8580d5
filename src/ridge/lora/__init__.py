"""LoRA adapters served over one base model: many fine-tunes for the bytes of one (S-LoRA's and punica's idea).

A step reads the base weights once for every sequence in it; each sequence's rows add their own adapter's low-rank
product. request.py names an adapter, adapter.py reads a PEFT directory into ridge's projections, apply.py adds
the products in a step (a tensor-parallel rank its part of them).
"""

from ridge.lora.request import LoRARequest

__all__ = ["LoRARequest"]
