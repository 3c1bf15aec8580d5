"""Random-weight models of any known shape: `--model random:llama-3-8b` (a preset) or `random:<config.json>`.

A GPU benchmark lent a machine that reaches no model hub still needs the model's shape, not its numbers:
the bytes a step moves and the FLOPs it runs are the same. Weights are drawn on the device from a fixed
seed (the same seed gives the same model on a device), so runs and engines can be compared. The outputs
are noise: everything that names such a model names it random.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ridge.models.presets import resolve_model
from ridge.models.spec import ModelSpec, nemotron_h_block_kinds

PREFIX = "random:"
INIT_STD = 0.02  # HF's initializer_range: activations stay of order one through the layers


def is_random(model: str | Path) -> bool:
    return str(model).startswith(PREFIX)


def random_spec(model: str) -> ModelSpec:
    """`random:NAME[,field=value...]` -> NAME's shape (a preset, a config.json or its directory, a GGUF header)
    with those fields changed (e.g. `random:llama-3-8b,vocab_size=49152`), named as given."""
    name, *assignments = model.removeprefix(PREFIX).split(",")
    spec = resolve_model(name)
    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    for item in assignments:
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise ValueError(f"model: {item!r} in {model!r} is not FIELD=VALUE of a model shape field")
        current = getattr(spec, key)
        kind = type(current) if current is not None else str
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    if "num_layers" in changes:  # fewer layers (to fit this machine): the state-space and NoPE ones among them stay so
        for key in ("ssm_layers", "nope_layers", "dense_only_layers", "mlp_free_layers"):
            changes.setdefault(key, tuple(i for i in getattr(spec, key) if i < changes["num_layers"]))
    spec = dataclasses.replace(spec, **changes, name=model)
    if not spec.architecture:
        raise ValueError(f"model: {model!r} names no architecture; add architecture to its preset or config")
    return spec.validate()


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The HF transformers config of `spec`'s shape (the random-model baseline of `ridge bench`): each family's
    keys under the names its HF config reads (a key another family's config does not know is inert there)."""
    config: dict[str, Any] = {
        "model_type": spec.architecture, "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.qkv_bias,
        # a family's default padding token can lie past a cut vocabulary (SmolLM3's 128004): none
        "pad_token_id": None,
    }
    if spec.partial_rotary_factor != 1.0:  # GLM-4.5's half, MiniMax-M2's rotary_dim
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.rope_theta,
                                     "partial_rotary_factor": spec.partial_rotary_factor}
        config["rotary_dim"] = int(spec.head_dim * spec.partial_rotary_factor)
    if spec.sliding_window:  # Mistral's on every layer; Gemma's, gpt-oss's, OLMo-3's, EXAONE 4's on all but every n-th
        config["sliding_window"] = spec.sliding_window
        if spec.global_every:
            config["layer_types"] = ["full_attention" if (i + 1) % spec.global_every == 0 else "sliding_attention"
                                     for i in range(spec.num_layers)]
    else:  # none, where a family's config has one by default (Mistral's, EXAONE 4's)
        config.update(sliding_window=None, layer_types=["full_attention"] * spec.num_layers)
    if spec.nope_layers:  # SmolLM3's
        config["no_rope_layers"] = [int(i not in spec.nope_layers) for i in range(spec.num_layers)]
    if spec.architecture == "glm4_moe":
        config["use_qk_norm"] = spec.qk_norm_params > 0
    if spec.is_moe:  # Qwen's and OLMoE's, Mixtral's and DeepSeek's names for the same numbers
        config.update(num_experts=spec.num_experts, num_local_experts=spec.num_experts,
                      n_routed_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.moe_intermediate_size, n_shared_experts=spec.shared_experts,
                      first_k_dense_replace=spec.first_dense_layers, mlp_only_layers=list(spec.dense_only_layers),
                      shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                      n_group=spec.router_groups, topk_group=spec.router_topk_groups,
                      routed_scaling_factor=spec.routed_scaling_factor)
        if spec.norm_topk_prob is not None:
            config["norm_topk_prob"] = spec.norm_topk_prob
        if spec.router_topk_method:
            config["topk_method"] = spec.router_topk_method
    if spec.rope_scaling:
        config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": spec.rope_theta,
                                     **spec.rope_scaling}
    if spec.architecture in ("cohere", "cohere2"):  # its LayerNorms' epsilon; its logit_scale multiplies
        config.update(layer_norm_eps=spec.rms_norm_eps, logit_scale=1 / spec.logits_scaling)
    if spec.architecture == "bert":  # its LayerNorms' epsilon, token types, exact GELU
        config.update(layer_norm_eps=spec.rms_norm_eps, type_vocab_size=spec.type_vocab_size, hidden_act="gelu")
    if spec.architecture == "starcoder2":  # one use_bias, its LayerNorms' epsilon, its ungated MLP's GELU-tanh
        config.update(use_bias=spec.mlp_bias, norm_epsilon=spec.rms_norm_eps, hidden_act="gelu_pytorch_tanh")
    if spec.architecture == "ernie4_5_moe":  # its own names for the shared experts and the leading dense layers
        config.update(moe_num_shared_experts=spec.shared_experts, moe_layer_start_index=spec.first_dense_layers)
    if spec.architecture == "olmo3":  # a rotary per kind of layer: the windowed ones' never scaled
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope_scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_theta or spec.rope_theta}}
    if spec.is_mla:
        config.update(kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank or None,
                      qk_rope_head_dim=spec.qk_rope_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
                      v_head_dim=spec.v_head_dim)
    if spec.index_topk:  # DeepSeek-V3.2's and GLM-5's indexer, on every layer (their own layer_types' kind)
        config.update(index_topk=spec.index_topk, index_n_heads=spec.index_heads, index_head_dim=spec.index_head_dim,
                      layer_types=None)
    ssm = {"n_heads": spec.ssm_num_heads, "d_head": spec.ssm_head_dim, "d_state": spec.ssm_state_size,
           "n_groups": spec.ssm_groups, "d_conv": spec.ssm_conv_kernel,
           "expand": spec.ssm_inner_size // spec.hidden_size, "chunk_size": spec.ssm_chunk_size}
    if spec.architecture == "mamba2":
        config.update(num_heads=ssm["n_heads"], head_dim=ssm["d_head"], state_size=ssm["d_state"],
                      n_groups=ssm["n_groups"], conv_kernel=ssm["d_conv"], expand=ssm["expand"],
                      chunk_size=ssm["chunk_size"], layer_norm_epsilon=spec.rms_norm_eps,
                      residual_in_fp32=spec.residual_in_fp32)
    elif spec.ssm_layers and spec.state_mixer == "mamba2":  # Bamba's and Granite 4.0-H's
        config.update({f"mamba_{key}": value for key, value in ssm.items()},
                      attn_layer_indices=[i for i in range(spec.num_layers) if i not in spec.ssm_layers])
    if spec.architecture in ("lfm2", "lfm2_moe"):  # the FFN's width as built (not adjusted again)
        kinds = ["conv" if i in spec.ssm_layers else "full_attention" for i in range(spec.num_layers)]
        config.update(layer_types=kinds, conv_L_cache=spec.ssm_conv_kernel, conv_bias=spec.ssm_conv_bias,
                      block_auto_adjust_ff_dim=False, norm_eps=spec.rms_norm_eps,
                      num_dense_layers=spec.first_dense_layers)
    if spec.state_mixer == "gated_delta":  # Qwen3.5's text model (not its multimodal wrapper's config), Qwen3-Next
        config.update(model_type={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(
                          spec.architecture, spec.architecture),
                      layer_types=["linear_attention" if i in spec.ssm_layers else "full_attention"
                                   for i in range(spec.num_layers)],
                      linear_num_value_heads=spec.ssm_num_heads, linear_value_head_dim=spec.ssm_head_dim,
                      linear_num_key_heads=spec.ssm_groups, linear_key_head_dim=spec.ssm_state_size,
                      linear_conv_kernel_dim=spec.ssm_conv_kernel,
                      rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                       "partial_rotary_factor": spec.partial_rotary_factor})
    if spec.architecture.startswith("granite"):
        config.update(embedding_multiplier=spec.embedding_multiplier, residual_multiplier=spec.residual_multiplier,
                      attention_multiplier=spec.attention_multiplier or spec.head_dim**-0.5,
                      logits_scaling=spec.logits_scaling)
    if spec.architecture in ("granitemoe", "granitemoehybrid"):  # the shared MLP: beside the experts, or the FFN
        config["shared_intermediate_size"] = (spec.shared_expert_intermediate_size if spec.is_moe
                                              else spec.intermediate_size)
    if spec.architecture == "granitemoehybrid":
        config.update(num_local_experts=spec.num_experts,
                      position_embedding_type="rope" if spec.partial_rotary_factor else "nope",
                      layer_types=["mamba" if i in spec.ssm_layers else "attention" for i in range(spec.num_layers)])
    if spec.architecture == "nemotron_h":  # its blocks, its Mamba-2 keys under its own names, its squared ReLU
        config.pop("layer_types", None)  # its config's other name for the blocks
        config.update(layers_block_type=nemotron_h_block_kinds(spec.num_layers, spec.ssm_layers, spec.mlp_free_layers),
                      mamba_num_heads=spec.ssm_num_heads, mamba_head_dim=spec.ssm_head_dim,
                      ssm_state_size=spec.ssm_state_size, n_groups=spec.ssm_groups, conv_kernel=spec.ssm_conv_kernel,
                      chunk_size=spec.ssm_chunk_size, expand=spec.ssm_inner_size // spec.hidden_size,
                      mlp_hidden_act="relu2", layer_norm_epsilon=spec.rms_norm_eps, num_hidden_layers=None,
                      moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size
                      or spec.moe_intermediate_size)
    if spec.architecture == "llama4":  # its text model: the experts' width its intermediate_size, chunked windows
        step = spec.moe_layer_step
        config.update(model_type="llama4_text", intermediate_size=spec.moe_intermediate_size,
                      intermediate_size_mlp=spec.intermediate_size, interleave_moe_layer_step=step,
                      moe_layers=[i for i in range(spec.num_layers) if i not in spec.dense_layer_indices],
                      attention_chunk_size=spec.sliding_window or None, use_qk_norm=spec.qk_l2_norm,
                      attn_temperature_tuning=spec.nope_temperature is not None, layer_types=None)
        if spec.nope_temperature is not None:
            config.update(attn_scale=spec.nope_temperature[0], floor_scale=spec.nope_temperature[1])
    if spec.architecture == "gemma4":  # its text model: the global layers' heads, KV sharing, per-layer embeddings
        config.update(model_type="gemma4_text", global_head_dim=spec.global_head_dim or spec.head_dim,
                      num_global_key_value_heads=spec.global_kv_heads or None,
                      attention_k_eq_v=spec.global_values_from_keys, num_kv_shared_layers=spec.kv_shared_layers,
                      use_double_wide_mlp=spec.double_wide_shared_mlp,
                      hidden_size_per_layer_input=spec.per_layer_input_size,
                      vocab_size_per_layer_input=spec.vocab_size, final_logit_softcapping=spec.final_logit_softcap,
                      hidden_activation="gelu_pytorch_tanh", enable_moe_block=spec.moe_beside_mlp,
                      top_k_experts=spec.experts_per_token or None,
                      rope_parameters={
                          "full_attention": {"rope_type": "proportional", "rope_theta": spec.rope_theta,
                                             "partial_rotary_factor": spec.global_rotary_fraction},
                          "sliding_attention": {"rope_type": "default",
                                                "rope_theta": spec.rope_local_theta or spec.rope_theta}})
    return config


def random_tensors(shapes: dict[str, torch.Size], dtype: torch.dtype, device: str | torch.device,
                   seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights for every parameter in `shapes` (a model's state dict on the meta device), one at a time, in its
    order: matrices drawn from N(0, INIT_STD) on the device, norm weights one (the multiplier itself: an offset is
    folded in at load), biases zero. Each matrix from its own generator, seeded by `seed` and its name: its numbers
    do not depend on which tensors were drawn before it."""
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) > 1:
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor.normal_(0.0, INIT_STD, generator=generator)
        elif name.endswith("bias"):
            tensor.zero_()
        else:
            tensor.fill_(1.0)
        yield name, tensor
