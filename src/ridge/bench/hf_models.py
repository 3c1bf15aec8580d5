"""HF transformers' own model of a ridge model file (a GGUF, dequantized, or an HF directory), in float32: the
in-process baseline of the benchmarks that run one (bench lora's PEFT, bench embed's base model)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_causal_lm(path: Path) -> torch.nn.Module | str:
    """The model, or the reason it cannot be had (transformers missing, a random model with no file)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return "transformers is not installed; left out"
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return f"{path} is neither a GGUF file nor an HF directory; left out"
