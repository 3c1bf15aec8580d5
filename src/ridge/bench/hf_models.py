"""HF transformers' own model of a ridge model file (a GGUF, dequantized, or an HF directory), in float32: the
in-process baseline of the benchmarks that run one (bench lora's PEFT, bench embed's base model or encoder)."""

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


def hf_encoder(path: Path) -> torch.nn.Module | str:
    """An encoder's HF base model (BertModel, RobertaModel...) from its folder, or the reason it cannot be had."""
    try:
        from transformers import AutoModel
    except ImportError:
        return "transformers is not installed; left out"
    if path.is_dir():
        return AutoModel.from_pretrained(path, dtype=torch.float32)
    return f"{path} is not an HF directory; left out"


def saved_random_model(model: str, folder: Path, seed: int = 0) -> Path | str:
    """`random:NAME`'s shape with weights drawn by HF's own initialiser, saved in `folder` as an HF checkpoint
    (safetensors, and a byte-level tokenizer: ids 0-255 are bytes) that ridge and HF transformers both load; the
    folder, or the reason it cannot be made."""
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        return "transformers is not installed; left out"
    from ridge.models.random_weights import hf_config, random_spec
    from ridge.models.registry import check_supported
    from ridge.tokenizer import byte_level_tokenizer

    spec = random_spec(model)
    fields = dict(hf_config(spec))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    encoder = check_supported(spec.architecture) == "bert"
    built = (AutoModel if encoder else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    built.save_pretrained(folder)
    byte_level_tokenizer(spec.vocab_size)[0].save(str(folder / "tokenizer.json"))
    return folder
