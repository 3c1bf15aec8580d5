"""Architecture name -> the ModelConfig fields that make it what it is.

llama, qwen2 and qwen3 run on one DecoderModel; what differs is a bias here, a norm there.
"""

from __future__ import annotations

from typing import Any

from ridge.config import ModelConfig

# per architecture: fixed ModelConfig fields
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}

# HF `architectures[0]` / `model_type` -> our name
_HF_NAMES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


def check_supported(architecture: str) -> str:
    name = _HF_NAMES.get(architecture, architecture)
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return name


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    arch = check_supported((hf.get("architectures") or [hf.get("model_type", "")])[0])
    heads = hf["num_attention_heads"]
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(hf),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
    }
    fields.update(ARCHITECTURES[arch])
    if arch == "llama":
        fields["qkv_bias"] = bool(hf.get("attention_bias", False))
    scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope_scaling: {scaling} is not supported yet (only plain rotary)")
    return ModelConfig(**fields)


def _rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def config_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """tensor_shapes in PyTorch order (GGUF stores dimensions reversed)."""
    arch = check_supported(meta["general.architecture"])

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_layers": key("block_count"),
        "num_heads": heads,
        "num_kv_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    fields.update(ARCHITECTURES[arch])
    if arch == "llama":
        fields["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    return ModelConfig(**fields)
