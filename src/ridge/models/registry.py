"""Architecture name -> the ModelConfig fields that make it what it is.

llama, mistral, qwen2, qwen3, gemma2 and gemma3 run on one DecoderModel; what differs is a bias here, a
norm there, a sliding window, Gemma's GeGLU, scaled embeddings and sandwich norms.
"""

from __future__ import annotations

from typing import Any

from ridge.config import ModelConfig
from ridge.models.spec import ModelSpec

# per architecture: fixed ModelConfig fields
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},  # llama with a sliding window on every layer (from its config)
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {"embedding_scale": True, "sandwich_norms": True, "norm_weight_offset": 1.0},
    "gemma3": {"embedding_scale": True, "sandwich_norms": True, "norm_weight_offset": 1.0, "qk_norm": True},
}

# HF `architectures[0]` / `model_type` -> our name
_HF_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model; the vision tower is not loaded
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "llama": "llama",
    "mistral": "mistral",
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


def config_from_spec(spec: ModelSpec) -> ModelConfig:
    """What the engine runs of a model read by models/spec.py; ValueError naming what it cannot run."""
    arch = check_supported(spec.architecture)
    if spec.rope_scaling is not None:
        raise ValueError(f"rope_scaling: {spec.rope_scaling!r} is not supported yet (only plain rotary)")
    if spec.is_moe or spec.is_mla:
        raise ValueError(f"{spec.source}: {'mixture of experts' if spec.is_moe else 'latent attention (MLA)'} is "
                         "not supported yet")
    if spec.sliding_window and arch.startswith("qwen"):  # Qwen's windows start at max_window_layers
        raise ValueError(f"{spec.source}: use_sliding_window is not supported for {arch}")
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "qkv_bias": spec.qkv_bias,
        "sliding_window": spec.sliding_window,
        "global_every": spec.global_every,
        "rope_local_theta": spec.rope_local_theta,
        "hidden_act": spec.hidden_act,
        "query_pre_attn_scalar": spec.query_pre_attn_scalar,
        "attn_logit_softcap": spec.attn_logit_softcap,
        "final_logit_softcap": spec.final_logit_softcap,
    }
    fields.update(ARCHITECTURES[arch])
    return ModelConfig(**fields)
