"""A model's shape, read once from whatever describes it: an HF config.json or a GGUF header.

The planner reasons about it (`ridge plan`, any architecture, presets.toml's too); the engine derives the
ModelConfig it runs from it (models/registry.py), refusing what it cannot run. One reader for both, so the
two never disagree about a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gguf.quants import dequantize

from ridge.models.gguf_file import GGUFFile
from ridge.multimodal.vision_config import VisionConfig

STATE_MIXERS = ("mamba2", "short_conv", "gated_delta")


@dataclass(frozen=True)
class AttentionLayers:
    """A run of alike attention layers of a model (ModelSpec.attention_layer_kinds)."""

    count: int
    kv_heads: int
    head_dim: int
    local: bool  # windowed
    holds_kv: bool  # else it attends to an earlier layer's cache (KV sharing)
    projected_kv: int  # K / V projections: 2, 1 (values the keys' projection), 0 (KV-shared)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: enough to count its parameters, FLOPs and KV bytes."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense FFN's width (of the dense layers, in an MoE model)
    tie_word_embeddings: bool = False
    gated_ffn: bool = True  # SwiGLU / GeGLU: gate, up and down matrices; else up and down
    qkv_bias: bool = False
    # mixture of experts: each MoE layer holds num_experts FFNs of moe_intermediate_size and runs
    # experts_per_token of them, plus shared_experts always-on ones; the first first_dense_layers are dense
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0
    shared_expert_intermediate_size: int = 0  # a shared expert's width, where not moe_intermediate_size (Qwen2-MoE)
    shared_expert_gate: bool = False  # Qwen2-MoE's: the shared expert's output scaled by a sigmoid of one row's product
    # multi-head latent attention (DeepSeek): the cache holds a kv_lora_rank latent and one shared rotary
    # key of qk_rope_head_dim per token and layer, instead of K and V per KV head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): beside the latent, an indexer key of index_head_dim per
    # token and layer, which index_heads heads score; each query attends to its index_topk best keys
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    # local / global attention (Gemma 3): all but every global_every-th layer see only sliding_window tokens
    sliding_window: int = 0
    global_every: int = 0
    nope_layers: tuple[int, ...] = ()  # attention layers without rotary (SmolLM3's no_rope_layers)
    # a bias on o_proj, where the checkpoint says so apart from q / k / v's (Seed-OSS's attention_out_bias); None:
    # the architecture's rule (registry.py)
    attention_out_bias: bool | None = field(default=None, compare=False)
    # Mamba-2 state-space layers in place of attention at ssm_layers (all of them in Mamba-2's own models, some in a
    # hybrid: Bamba): each keeps a fixed state per sequence, ssm_num_heads x ssm_head_dim x ssm_state_size, and
    # the last ssm_conv_kernel - 1 inputs of its convolution, instead of K and V per token
    ssm_layers: tuple[int, ...] = ()
    ssm_num_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state_size: int = 0
    ssm_groups: int = 1
    ssm_conv_kernel: int = 4
    # the mixer of those layers: "mamba2", or "short_conv" (LFM2's gated short convolution: its state the last
    # ssm_conv_kernel - 1 inputs of a hidden-wide convolution, no SSM heads), or "gated_delta" (Qwen3.5's gated
    # DeltaNet: ssm_num_heads value heads of ssm_head_dim, each a state of ssm_head_dim x ssm_state_size (the key
    # heads' width), in ssm_groups groups that share a query and key head)
    state_mixer: str = "mamba2"
    # Qwen3.5 / Qwen3-Next: the query projection also gives a gate per query row, the attention's output times its
    # sigmoid
    attention_output_gate: bool = False
    has_ffn: bool = True  # Mamba-2's own layers hold the mixer only
    mlp_free_layers: tuple[int, ...] = ()  # layers whose mixer has no FFN after it (Nemotron-H's mixer after mixer)
    # the weights of an attention layer's q and k norms: a head's width each (Qwen3, Gemma 3, LFM2), all heads'
    # (OLMoE), or none
    qk_norm_params: int = 0
    # Gemma 4: the global layers' own head width and KV heads (0: the model's), their values the keys' projection
    # (attention_k_eq_v); the last kv_shared_layers layers attend to an earlier layer's cache and project no K / V
    # (their MLPs twice as wide with double_wide_shared_mlp); per-layer embeddings of per_layer_input_size per layer
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_values_from_keys: bool = False
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    moe_beside_mlp: bool = False  # Gemma 4 26B-A4B's: each layer's experts beside a dense FFN of intermediate_size
    # an encoder's (BERT's) token type table (0: none); its position table's rows are max_position_embeddings
    type_vocab_size: int = 0
    num_labels: int = 0  # a sequence classifier's head: its labels (a cross-encoder's one relevance logit)
    # a vision-language model's (Qwen2-VL's): its vision tower (not counted in the shape's parameters), its image
    # placeholder token, its multimodal rotary's sections
    vision: VisionConfig | None = field(default=None, compare=False)
    image_token_id: int | None = field(default=None, compare=False)
    mrope_section: tuple[int, ...] | None = field(default=None, compare=False)
    mrope_interleaved: bool = field(default=False, compare=False)
    source: str = ""
    # what the engine needs beyond the shape, read by the same readers; not compared (a preset has none)
    architecture: str = field(default="", compare=False)  # HF model_type / GGUF general.architecture
    rms_norm_eps: float = field(default=1e-6, compare=False)
    rope_theta: float = field(default=10000.0, compare=False)
    # a scaled rotary (ridge/rope_scaling.py reads it, the engine refuses what it cannot run): HF's rope_scaling
    # dict, or the same keys made from a GGUF header (with llama3's divisors read from the rope_freqs tensor)
    rope_scaling: dict | None = field(default=None, compare=False)
    max_position_embeddings: int = field(default=4096, compare=False)
    hidden_act: str = field(default="silu", compare=False)  # silu or gelu_tanh
    query_pre_attn_scalar: float | None = field(default=None, compare=False)
    rope_local_theta: float | None = field(default=None, compare=False)
    attn_logit_softcap: float | None = field(default=None, compare=False)
    final_logit_softcap: float | None = field(default=None, compare=False)
    norm_topk_prob: bool | None = field(default=None, compare=False)  # None: the architecture's default
    moe_layer_step: int = field(default=1, compare=False)  # every n-th layer is MoE (Qwen's decoder_sparse_step)
    dense_only_layers: tuple[int, ...] = field(default=(), compare=False)  # Qwen's mlp_only_layers
    clip_qkv: float | None = field(default=None, compare=False)  # OLMo's clamp of q, k, v
    mlp_bias: bool = field(default=False, compare=False)  # biases on the FFN's projections (llama's mlp_bias)
    # RoBERTa's: the first learned position's row in its table (its padding index + 1), the rows before unused
    position_offset: int = field(default=0, compare=False)
    label_names: tuple[str, ...] = field(default=(), compare=False)  # a classifier's labels, by index (id2label)
    # DeepSeek-V3's router (group-limited, sigmoid) and its checkpoints' interleaved rotary dims
    router_groups: int = field(default=1, compare=False)
    router_topk_groups: int = field(default=1, compare=False)
    routed_scaling_factor: float = field(default=1.0, compare=False)
    router_topk_method: str = field(default="", compare=False)  # DeepSeek-V2's greedy / group_limited_greedy
    moe_layer_freq: int = field(default=1, compare=False)  # DeepSeek's: every n-th layer past the dense ones
    rope_interleave: bool = field(default=False, compare=False)
    partial_rotary_factor: float = field(default=1.0, compare=False)  # rotary on this share of a head's dims
    ssm_chunk_size: int = field(default=256, compare=False)
    ssm_heads_tiled: bool = field(default=False, compare=False)  # ModelConfig's: a qwen35 GGUF's value-head order
    ssm_conv_bias: bool = field(default=True, compare=False)
    ssm_proj_bias: bool = field(default=False, compare=False)
    ssm_dt_limit: tuple[float, float] = field(default=(0.0, float("inf")), compare=False)
    residual_in_fp32: bool = field(default=False, compare=False)  # Mamba-2's: the residual stream kept in float32
    # Granite's scalars (ModelConfig's fields of the same names)
    embedding_multiplier: float = field(default=1.0, compare=False)
    residual_multiplier: float = field(default=1.0, compare=False)
    attention_multiplier: float | None = field(default=None, compare=False)
    logits_scaling: float = field(default=1.0, compare=False)
    swiglu_limit: float = field(default=7.0, compare=False)  # gpt-oss's clamped SwiGLU (ModelConfig's)
    swiglu_alpha: float = field(default=1.702, compare=False)
    # Llama 4's: chunked windows (kv/layout.py's Window), q / k L2-normed, and the NoPE layers' temperature (scale,
    # period: rope_scaling.py's AttentionTemperature)
    chunked_window: bool = field(default=False, compare=False)
    qk_l2_norm: bool = field(default=False, compare=False)
    nope_temperature: tuple[float, int] | None = field(default=None, compare=False)
    global_rotary_fraction: float = field(default=1.0, compare=False)  # Gemma 4's proportional rotary (ModelConfig's)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layer_indices(self) -> tuple[int, ...]:
        """The layers of an MoE model that keep a dense FFN (none where the model has no experts)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_free_layers and (
            i < self.first_dense_layers or i in self.dense_only_layers or (i + 1) % self.moe_layer_step))

    @property
    def num_ffn_layers(self) -> int:
        """The layers with an FFN (dense or a mixture) after their mixer."""
        return self.num_layers - len(self.mlp_free_layers) if self.has_ffn else 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_ffn_layers - len(self.dense_layer_indices) if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers - len(self.ssm_layers)

    @property
    def ssm_inner_size(self) -> int:
        return self.ssm_num_heads * self.ssm_head_dim

    @property
    def ssm_conv_channels(self) -> int:
        """What a state-space layer's causal convolution runs over: Mamba-2's x, B and C; LFM2's gated input."""
        if self.state_mixer == "short_conv":
            return self.hidden_size
        return self.ssm_inner_size + 2 * self.ssm_groups * self.ssm_state_size

    @property
    def attention_kind(self) -> str:
        if not self.num_attention_layers:
            return "no attention"
        if self.is_mla:
            return f"MLA, sparse: top {self.index_topk} keys" if self.index_topk else "MLA"
        kind = "MHA" if self.num_kv_heads == self.num_heads else "MQA" if self.num_kv_heads == 1 else "GQA"
        if self.global_head_dim or self.global_kv_heads:  # Gemma 4's
            keys_as_values = ", keys as values" if self.global_values_from_keys else ""
            kind += (f"; global layers {self.global_kv_heads or self.num_kv_heads} KV heads of "
                     f"{self.global_head_dim or self.head_dim}{keys_as_values}")
        if self.kv_shared_layers:
            kind += f"; the last {self.kv_shared_layers} layers share earlier layers' KV"
        return kind

    @property
    def local_layers(self) -> int:
        """Layers that attend to at most sliding_window tokens."""
        if not self.sliding_window:
            return 0
        if not self.global_every:
            return self.num_attention_layers
        return self.num_layers - self.num_layers // self.global_every

    def is_local(self, layer: int) -> bool:
        """Whether an attention layer is windowed (ModelConfig.is_local's rule)."""
        return bool(self.sliding_window) and (not self.global_every or (layer + 1) % self.global_every != 0)

    def attention_layer_kinds(self) -> list[AttentionLayers]:
        """The attention layers in runs of alike ones (not latent attention's): global and windowed, each as its
        heads are (Gemma 4's global ones: wider, fewer KV heads) and as it caches (KV-shared layers: none)."""
        first_shared = self.num_layers - self.kv_shared_layers
        counts: dict[tuple[bool, bool], int] = {}
        for layer in range(self.num_layers):
            if layer not in self.ssm_layers:
                key = (self.is_local(layer), layer < first_shared)
                counts[key] = counts.get(key, 0) + 1
        kinds = []
        for (local, holds_kv), count in sorted(counts.items()):
            wide = bool(self.global_head_dim) and not local
            kv_heads = self.global_kv_heads if self.global_kv_heads and not local else self.num_kv_heads
            projected = 0 if not holds_kv else 1 if self.global_values_from_keys and not local else 2
            kinds.append(AttentionLayers(count, kv_heads, self.global_head_dim if wide else self.head_dim, local,
                                         holds_kv, projected))
        return kinds

    def validate(self) -> ModelSpec:
        attention = ("num_heads", "num_kv_heads", "head_dim") if self.num_attention_layers else ()
        for f in ("vocab_size", "hidden_size", "num_layers", *attention):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f} must be positive, got {getattr(self, f)}")
        if any(not 0 <= i < self.num_layers for i in self.ssm_layers):
            raise ValueError(f"model {self.name}: ssm_layers {list(self.ssm_layers)} must be layers "
                             f"0..{self.num_layers - 1}")
        if self.state_mixer not in STATE_MIXERS:
            raise ValueError(f"model {self.name}: state_mixer {self.state_mixer!r} is not one of "
                             f"{', '.join(STATE_MIXERS)}")
        if self.ssm_layers and self.state_mixer != "short_conv" and min(
                self.ssm_num_heads, self.ssm_head_dim, self.ssm_state_size) <= 0:
            raise ValueError(f"model {self.name}: state-space layers need positive ssm_num_heads, ssm_head_dim and "
                             "ssm_state_size")
        if attention and self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"model {self.name}: experts_per_token must be in 1..num_experts ({self.num_experts})")
        return self




# HF config.json keys -> ModelSpec fields (first key present wins)
_HF_KEYS = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "block_ff_dim"),
    "tie_word_embeddings": ("tie_word_embeddings", "tie_embedding"),
    "qkv_bias": ("attention_bias",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "experts_per_token": ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k_experts"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_experts": ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts"),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    "first_dense_layers": ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"),
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "index_topk": ("index_topk",),
    "index_heads": ("index_n_heads",),
    "index_head_dim": ("index_head_dim",),
    "sliding_window": ("sliding_window",),
    "global_every": ("sliding_window_pattern",),
}


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    """An HF config.json's model, of any architecture (the engine refuses what it cannot run)."""
    outer, config = config, config.get("text_config", config)  # multimodal configs nest the language model's
    fields: dict = {}
    for spec_field, keys in _HF_KEYS.items():
        for key in keys:
            if config.get(key) is not None:
                fields[spec_field] = config[key]
                break
    fields.update(_ssm_fields(config, fields.get("hidden_size", 0), source))
    fields.update(_mlp_layer_types(config))
    if config.get("attention_out_bias") is not None:
        fields["attention_out_bias"] = bool(config["attention_out_bias"])
    if config.get("no_rope_layers"):  # SmolLM3's: 1 where a layer turns q and k, 0 where it does not
        fields["nope_layers"] = tuple(i for i, rope in enumerate(config["no_rope_layers"]) if not rope)
    if config.get("mlp_only_layers"):
        fields["dense_only_layers"] = tuple(config["mlp_only_layers"])
    fields.update(_granite_moe_fields(config, fields, source))
    fields.update(_llama4_fields(config, fields, source))
    fields.update(_gemma4_fields(config, source))
    fields.update(_starcoder2_fields(config))
    fields.update(_encoder_fields(config, source))
    for required in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
        if required not in fields:
            raise ValueError(f"{source}: no {required} ({' / '.join(_HF_KEYS[required])})")
    fields.setdefault("num_kv_heads", fields["num_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"] if fields["num_heads"] else 0)
    fields.setdefault("intermediate_size", 4 * fields["hidden_size"])
    if config.get("model_type", "").startswith("qwen2") and "qkv_bias" not in fields:
        fields["qkv_bias"] = True  # Qwen2 has q / k / v biases without saying so in its config
    if config.get("use_sliding_window") is False:
        fields.pop("sliding_window", None)
    if fields.get("num_experts") and not fields.get("moe_intermediate_size"):
        fields["moe_intermediate_size"] = fields["intermediate_size"]  # Mixtral: experts as wide as a dense FFN
    if fields.get("shared_expert_intermediate_size") and not fields.get("shared_experts"):
        fields["shared_experts"] = 1  # Qwen2-MoE: one shared expert, of its own width
    if config.get("model_type") in _GATED_SHARED_EXPERT and fields.get("shared_expert_intermediate_size"):
        fields["shared_expert_gate"] = True
    if "tie_word_embeddings" in outer and outer is not config:  # a multimodal model ties (or not) as a whole
        fields["tie_word_embeddings"] = outer["tie_word_embeddings"]
    if isinstance(fields.get("global_every"), str):  # EXAONE 4's "LLLG": local layers, then a global one
        fields["global_every"] = _pattern_period(fields["global_every"], source)
    if config.get("layer_types") and fields.get("sliding_window") and not fields.get("chunked_window"):
        # newer configs list each layer's kind
        fields["global_every"] = _global_every(config["layer_types"], source)
    if config.get("model_type") in ("exaone4", "exaone_moe", "cohere2") and fields.get("sliding_window"):
        # the global layers: NoPE
        fields["nope_layers"] = _global_layers(fields["num_layers"], fields.get("global_every"), source)
    fields["qkv_bias"] = bool(fields.get("qkv_bias", False))
    if fields.get("q_lora_rank") is None:
        fields.pop("q_lora_rank", None)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    local_scaling = scaling.get("sliding_attention") or {}
    scaling = scaling.get("full_attention", scaling)  # Gemma 3: one rotary per kind of layer
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "mrope" or "mrope_section" in scaling:  # Qwen-VL's: a text token turns a plain rotary
        fields.update(_vision_fields(outer, scaling, source))
        rope_type, scaling = "default", {key: value for key, value in scaling.items() if key == "rope_theta"}
    if outer.get("model_type") == "mistral3" and "vision_config" in outer:  # its images turn at their indexes
        fields.update(vision=VisionConfig.from_pixtral(outer, f"{source}: mistral3"),
                      image_token_id=int(outer.get("image_token_index", outer.get("image_token_id", 10))))
    if outer.get("model_type") == "gemma3" and "vision_config" in outer:
        fields.update(vision=VisionConfig.from_gemma3(outer, f"{source}: gemma3"),
                      image_token_id=int(outer.get("image_token_index", outer.get("image_token_id", 262144))))
    if config.get("model_type") == "phi3" and rope_type in ("su", "yarn"):  # HF's Phi3Config reads both as longrope
        rope_type, scaling = "longrope", {**scaling, "rope_type": "longrope"}
        scaling.pop("type", None)
    if rope_type == "longrope" and config.get("original_max_position_embeddings"):  # Phi-3's: beside the dict
        scaling = {"original_max_position_embeddings": config["original_max_position_embeddings"], **scaling}
    if rope_type == "proportional":  # Gemma 4's global layers: part of the frequencies turn, over the whole head
        fields["global_rotary_fraction"] = float(scaling.get("partial_rotary_factor", 1.0))
        if float(scaling.get("factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: rope_parameters: a proportional rotary's factor ({scaling['factor']}) is "
                             "not supported (1)")
        rope_type, scaling = "default", {"rope_theta": scaling.get("rope_theta", 10000.0)}
    local_type = local_scaling.get("rope_type", local_scaling.get("type", "default"))
    if local_type not in ("default", None):
        raise ValueError(f"{source}: rope_scaling: a scaled rotary on the sliding layers ({local_type}) is not "
                         "supported")
    local_theta = local_scaling.get("rope_theta", config.get("rope_local_base_freq"))
    if config.get("model_type") == "olmo3" and rope_type not in ("default", None) and local_theta is None:
        local_theta = config.get("rope_theta", scaling.get("rope_theta"))  # its windowed layers' rotary: unscaled
    activation = config.get("hidden_activation") or config.get("mlp_hidden_act") or config.get("hidden_act") or "silu"
    if activation == "gelu" and config.get("model_type") == "gemma":  # Gemma 1's legacy name: HF reads the tanh form
        activation = "gelu_tanh"
    head_dim = fields["head_dim"]
    per_head, all_heads = 2 * head_dim, (fields["num_heads"] + fields["num_kv_heads"]) * head_dim
    fields["qk_norm_params"] = {
        "qwen3": per_head, "qwen3_moe": per_head, "qwen3_vl": per_head, "qwen3_vl_text": per_head,
        "qwen3_vl_moe": per_head, "qwen3_vl_moe_text": per_head,
        "gemma3": per_head, "gemma3_text": per_head, "lfm2": per_head,
        "lfm2_moe": per_head, "olmoe": all_heads, "olmo2": all_heads, "olmo3": all_heads, "exaone4": per_head,
        **dict.fromkeys(_QWEN3_5, per_head),
        "glm4_moe": per_head if config.get("use_qk_norm") else 0, "dots1": per_head, "exaone_moe": per_head,
        # Command R+'s: a LayerNorm weight for each head of q and of k
        "cohere": all_heads if config.get("use_qk_norm") else 0,
        "minimax_m2": all_heads}.get(config.get("model_type"), 0)
    if config.get("rotary_dim") and head_dim:  # MiniMax-M2's checkpoints say it as the rotary width
        fields.setdefault("partial_rotary_factor", config["rotary_dim"] / head_dim)
    half = config.get("model_type") == "glm4"  # HF's Glm4Config: half of each head where a config does not say
    fields.setdefault("partial_rotary_factor", float(config.get("partial_rotary_factor", scaling.get(
        "partial_rotary_factor", 0.5 if half else 1.0))))
    fields.setdefault("mlp_bias", bool(config.get("mlp_bias", False)))
    _refuse_minimax_variants(config, source)
    _refuse_shared_indexer_layers(config, source)
    _refuse_ernie_variants(config, fields, source)
    architecture = (outer.get("architectures") or [outer.get("model_type", "")])[0]
    if architecture in TEXT_MODEL_WRAPPERS:  # a vision model around a language model of any family: that family's
        architecture = config.get("model_type", architecture)
    return ModelSpec(
        name=name, source=source, architecture=architecture,
        rms_norm_eps=float(config.get("rms_norm_eps", config.get("layer_norm_epsilon", config.get(
            "layer_norm_eps", config.get("norm_eps", config.get("norm_epsilon", 1e-6)))))),
        rope_theta=float(config.get("rope_theta", scaling.get("rope_theta", 10000.0))),
        # kept for a temperature too (models/registry.py reads it), where the rotary itself is plain
        rope_scaling=None if rope_type in ("default", None) and not scaling.get("llama_4_scaling_beta")
        else dict(scaling),
        max_position_embeddings=int(config.get("max_position_embeddings", fields.pop("max_position_embeddings", 4096))),
        hidden_act="gelu_tanh" if activation in ("gelu_pytorch_tanh", "gelu_tanh") else activation,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
        rope_local_theta=float(local_theta) if local_theta is not None else None,
        attn_logit_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"),
        # Qwen3-VL-MoE's router always renormalises its top k, and its config does not say so
        norm_topk_prob=config.get("norm_topk_prob", True if config.get("model_type", "").startswith("qwen3_vl_moe")
                                  else None),
        moe_layer_step=int(config.get("decoder_sparse_step") or fields.pop("moe_layer_step", 1)),
        clip_qkv=config.get("clip_qkv"),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        attention_multiplier=config.get("attention_multiplier"),
        # Cohere's logit_scale multiplies the logits that Granite's logits_scaling divides
        logits_scaling=float(config.get("logits_scaling", 1 / config.get("logit_scale", 1.0))),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)), swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        router_groups=int(config.get("n_group") or 1), router_topk_groups=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        router_topk_method=str(config.get("topk_method") or ""), moe_layer_freq=int(config.get("moe_layer_freq") or 1),
        rope_interleave=bool(config.get("rope_interleave", config.get("model_type") in _INTERLEAVED_LATENT_ROTARY)),
        **fields,
    ).validate()


# BERT's encoders (their HF model_type): RoBERTa and XLM-RoBERTa are BERT's layers with positions counted from
# their padding index + 1
ENCODERS = ("bert", "roberta", "xlm-roberta")
# their shape, whatever the file: biases on all six projections, an ungated MLP, no rotary (learned absolute
# positions instead), no output head (the embedding table stands in: an encoder generates nothing)
_ENCODER_SHAPE = {"qkv_bias": True, "attention_out_bias": True, "mlp_bias": True, "gated_ffn": False,
                  "partial_rotary_factor": 0.0, "tie_word_embeddings": True}


def _encoder_fields(config: dict, source: str) -> dict:
    """BERT's: its shape (_ENCODER_SHAPE), token types, RoBERTa's position offset; a sequence classifier's (a
    cross-encoder's) labels."""
    kind = config.get("model_type")
    if kind not in ENCODERS:
        return {}
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source}: position_embedding_type: {config['position_embedding_type']!r} is not "
                         "supported (absolute)")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ValueError(f"{source}: is_decoder / add_cross_attention: BERT as a decoder is not supported; ridge runs "
                         "BERT models as encoders (embeddings)")
    offset = int(config.get("pad_token_id") or 0) + 1 if kind != "bert" else 0
    architecture = (config.get("architectures") or [""])[0]
    names = config.get("id2label") or {}
    labels = len(names) or int(config.get("num_labels") or 2)
    if config.get("problem_type") not in (None, "regression", "single_label_classification"):
        raise ValueError(f"{source}: problem_type: {config['problem_type']!r} is not supported (one label per text)")
    return {**_ENCODER_SHAPE, "type_vocab_size": int(config.get("type_vocab_size") or 0), "position_offset": offset,
            "num_labels": labels if architecture.endswith("ForSequenceClassification") else 0,
            "label_names": tuple(str(names.get(str(i), names.get(i, i))) for i in range(labels))}


# the vision-language models whose vision tower ridge runs with M-RoPE (models/vision.py; Mistral 3's, without:
# models/pixtral.py); the others' language models serve text
VISION_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _vision_fields(outer: dict, scaling: dict, source: str) -> dict:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision tower, image placeholder and multimodal rotary sections (Qwen3-VL
    interleaves them, whatever its config says: HF's does)."""
    kind = outer.get("model_type")
    if kind not in VISION_MODELS or "vision_config" not in outer:
        return {}
    sections = tuple(int(n) for n in scaling.get("mrope_section") or ())
    interleaved = kind.startswith("qwen3_vl")
    if scaling.get("mrope_interleaved") and not interleaved:
        raise ValueError(f"{source}: rope_scaling.mrope_interleaved is not supported on {kind} (Qwen2-VL's sections "
                         "in runs)")
    image_token = outer.get("image_token_id", (outer.get("text_config") or {}).get("image_token_id"))
    if image_token is None or not sections:
        raise ValueError(f"{source}: a vision model needs image_token_id and rope_scaling.mrope_section")
    return {"vision": VisionConfig.from_hf(outer["vision_config"], kind, f"{source}: vision_config"),
            "image_token_id": int(image_token), "mrope_section": sections, "mrope_interleaved": interleaved}


def _starcoder2_fields(config: dict) -> dict:
    """StarCoder2's: one use_bias for all six projections (q, k, v, o and the MLP's two), and an ungated MLP (its
    GELU-tanh between c_fc and c_proj); its LayerNorms always have biases (registry.py's)."""
    if config.get("model_type") != "starcoder2":
        return {}
    bias = bool(config.get("use_bias", True))
    return {"qkv_bias": bias, "attention_out_bias": bias, "mlp_bias": bias, "gated_ffn": False}


# the latent-attention families whose checkpoints interleave their rotary dims where a config does not say
# (HF's default for them: DeepSeek-V3.2's and GLM-5's attention always does)
_INTERLEAVED_LATENT_ROTARY = ("deepseek_v3", "kimi_k2", "glm4_moe_lite", "mistral4", "deepseek_v32", "glm_moe_dsa")


def _refuse_shared_indexer_layers(config: dict, source: str) -> None:
    """GLM-5's indexer_types (or the pattern and period they are made from): a "shared" layer reuses the previous
    layer's choice of keys instead of running its own indexer, which ridge does not do: refused by name."""
    if config.get("model_type") != "glm_moe_dsa":
        return
    layers = int(config["num_hidden_layers"])
    kinds = config.get("indexer_types")
    if kinds is None and (pattern := config.get("index_topk_pattern")) is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if kinds is None:
        period, offset = max(int(config.get("index_topk_freq", 1)), 1), int(config.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % period == 0 else "shared" for i in range(layers)]
    if any(kind != "full" for kind in kinds):
        raise ValueError(f"{source}: indexer_types: layers that reuse another layer's sparse-attention choice "
                         f"({kinds.count('shared')} 'shared' of {layers}) are not supported (every layer 'full')")


def _gemma4_fields(config: dict, source: str) -> dict:
    """Gemma 4's shape beyond Gemma 3's: the global layers' heads (from per_layer_config, as HF saves it, or the
    global_head_dim / num_global_key_value_heads it is made from), KV sharing, per-layer embeddings, the 26B-A4B's
    experts beside the MLP; {} for others.
    What ridge does not run is refused by name: bidirectional attention."""
    if config.get("model_type") not in ("gemma4", "gemma4_text"):
        return {}
    if config.get("use_bidirectional_attention") == "all":
        raise ValueError(f"{source}: use_bidirectional_attention: 'all' (every token attending both ways) is not "
                         "supported; a decoder attends causally")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:  # HF's Gemma 4 turns its windowed heads whole
        raise ValueError(f"{source}: partial_rotary_factor: {config['partial_rotary_factor']} is not supported for "
                         "Gemma 4 (its global layers' share is their rope_parameters')")
    kinds = config.get("layer_types") or []
    overrides = config.get("per_layer_config")
    if overrides is None:  # HF's default where neither is given: 512-wide global heads
        global_kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v", True) else None
        overrides = {i: {"head_dim": config.get("global_head_dim", 512),
                         **({"num_key_value_heads": global_kv} if global_kv else {})}
                     for i, kind in enumerate(kinds) if kind == "full_attention"}
    overrides = {int(layer): dict(values) for layer, values in overrides.items()}
    global_layers = {i for i, kind in enumerate(kinds) if kind == "full_attention"}
    distinct = {tuple(sorted(values.items())) for values in overrides.values()}
    if set(overrides) != global_layers or len(distinct) > 1 or any(
            set(values) - {"head_dim", "num_key_value_heads"} for values in overrides.values()):
        raise ValueError(f"{source}: per_layer_config: overrides other than one head_dim / num_key_value_heads for "
                         f"every full_attention layer are not supported (got {config.get('per_layer_config')})")
    shared = overrides[min(overrides)] if overrides else {}
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    if per_layer and config.get("vocab_size_per_layer_input", config["vocab_size"]) != config["vocab_size"]:
        raise ValueError(f"{source}: vocab_size_per_layer_input ({config['vocab_size_per_layer_input']}) other "
                         f"than vocab_size ({config['vocab_size']}) is not supported")
    return {"global_head_dim": int(shared.get("head_dim", 0)),
            "global_kv_heads": int(shared.get("num_key_value_heads", 0)),
            "global_values_from_keys": bool(config.get("attention_k_eq_v", False)),
            "kv_shared_layers": int(config.get("num_kv_shared_layers") or 0),
            "double_wide_shared_mlp": bool(config.get("use_double_wide_mlp", False)),
            "per_layer_input_size": per_layer, "moe_beside_mlp": bool(config.get("enable_moe_block", False))}


# what llama.cpp's llama4 graph fixes: the chunks of its local layers, and its NoPE layers' temperature (scale, period)
LLAMA4_CHUNK = 8192
LLAMA4_TEMPERATURE = (0.1, 8192)


# multimodal checkpoints whose language model is of whichever family their text_config names (Mistral Small 3.1 /
# 3.2's, Pixtral's): served for text, the vision tower not loaded
TEXT_MODEL_WRAPPERS = ("Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration")


# the context of a model without positions (no attention, no rotary): a state-space model's is unbounded
NO_POSITION_LIMIT = 2**20


def _ssm_fields(config: dict, hidden: int, source: str) -> dict:
    """The state-space layers of a Mamba-2 model (all its layers, no FFN, no attention) or of a Bamba hybrid (the
    layers not in attn_layer_indices), from their configs' keys; {} for a model without them."""
    kind = config.get("model_type")
    if kind in ("lfm2", "lfm2_moe"):
        return _lfm2_fields(config, source)
    if kind == "nemotron_h":
        return _nemotron_h_fields(config, hidden, source)
    if kind in _QWEN3_5:
        return _qwen3_5_fields(config, source)
    if kind == "mamba2":
        layers = config["num_hidden_layers"]
        shape = {"ssm_layers": tuple(range(layers)), "has_ffn": False, "num_heads": 0, "num_kv_heads": 0,
                 "head_dim": 0, "intermediate_size": 0, "max_position_embeddings": NO_POSITION_LIMIT,
                 "residual_in_fp32": bool(config.get("residual_in_fp32", True))}  # HF's default
        keys = {"ssm_num_heads": "num_heads", "ssm_head_dim": "head_dim", "ssm_state_size": "state_size",
                "ssm_groups": "n_groups", "ssm_conv_kernel": "conv_kernel", "ssm_chunk_size": "chunk_size",
                "ssm_conv_bias": "use_conv_bias", "ssm_proj_bias": "use_bias"}
        expand = config.get("expand", 2)
    elif kind in ("bamba", "granitemoehybrid"):
        if kind == "bamba":
            attention = set(config.get("attn_layer_indices") or ())
            shape = {"ssm_layers": tuple(i for i in range(config["num_hidden_layers"]) if i not in attention)}
        else:
            shape = {"ssm_layers": _granite_mamba_layers(config, source)}
        keys = {"ssm_num_heads": "mamba_n_heads", "ssm_head_dim": "mamba_d_head", "ssm_state_size": "mamba_d_state",
                "ssm_groups": "mamba_n_groups", "ssm_conv_kernel": "mamba_d_conv", "ssm_chunk_size": "mamba_chunk_size",
                "ssm_conv_bias": "mamba_conv_bias", "ssm_proj_bias": "mamba_proj_bias"}
        expand = config.get("mamba_expand", 2)
    else:
        return {}
    return {**shape, **_mamba2_shape(config, keys, expand, hidden, source)}


def _mamba2_shape(config: dict, keys: dict[str, str], expand: int, hidden: int, source: str) -> dict:
    """The Mamba-2 mixers' fields from `config`'s keys (ridge's name -> the config's), their heads checked to span
    expand x hidden_size, and dt's limit."""
    shape = {name: config[key] for name, key in keys.items() if config.get(key) is not None}
    if shape.get("ssm_head_dim") in (None, "auto"):  # Bamba's default: the inner width split over the heads
        shape["ssm_head_dim"] = expand * hidden // shape["ssm_num_heads"]
    if shape["ssm_num_heads"] * shape["ssm_head_dim"] != expand * hidden:
        raise ValueError(f"{source}: the SSM's heads ({shape['ssm_num_heads']} x {shape['ssm_head_dim']}) must span "
                         f"expand x hidden_size ({expand} x {hidden})")
    if (limit := config.get("time_step_limit")) is not None:
        shape["ssm_dt_limit"] = (_json_float(limit[0]), _json_float(limit[1]))
    return shape


# Nemotron-H's kinds of block, as its configs spell them (layers_block_type, or the older hybrid_override_pattern)
_NEMOTRON_H_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba",
                      "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
                      "mlp": "mlp", "moe": "moe"}


# the older names of Nemotron-H's Mamba-2 keys, which its published configs may hold (HF reads both)
_NEMOTRON_H_LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                           "mamba_chunk_size": "chunk_size", "mamba_conv_bias": "use_conv_bias",
                           "mamba_dt_limit": "time_step_limit"}


def nemotron_h_layers(config: dict, source: str = "config.json") -> list[tuple[int, str, int | None]]:
    """Nemotron-H's blocks, each one sublayer (a Mamba-2 mixer, attention, an MLP or a mixture) after its own norm,
    as ridge's layers: each mixer block with the FFN block that follows it, if one does: [(mixer block, "mamba" or
    "attention", FFN block or None)]. An FFN block that follows no mixer has no place: refused by name."""
    kinds = config.get("layers_block_type") or list(config.get("hybrid_override_pattern") or "")
    if not kinds or set(kinds) - set(_NEMOTRON_H_BLOCKS):
        raise ValueError(f"{source}: layers_block_type: Nemotron-H's blocks (mamba, attention, mlp, moe) expected, got "
                         f"{kinds}")
    layers: list[tuple[int, str, int | None]] = []
    for i, kind in enumerate(_NEMOTRON_H_BLOCKS[kind] for kind in kinds):
        if kind in ("mamba", "attention"):
            layers.append((i, kind, None))
        elif layers and layers[-1][0] == i - 1 and layers[-1][2] is None:  # the FFN of the mixer just before it
            layers[-1] = (*layers[-1][:2], i)
        else:
            raise ValueError(f"{source}: layers_block_type: block {i} ({kind}) follows no mixer; ridge runs an FFN "
                             "after a Mamba-2 or attention block only")
    return layers


def _nemotron_h_fields(config: dict, hidden: int, source: str) -> dict:
    """Nemotron-H (Nemotron Nano 2, Nemotron 3): one sublayer a block, read as ridge's layers (nemotron_h_layers):
    Mamba-2 mixers and attention without rotary, each with the squared-ReLU MLP (or mixture) that follows it."""
    if config.get("moe_latent_size"):
        raise ValueError(f"{source}: moe_latent_size: Nemotron-H's experts in a latent space are not supported")
    if config.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: mamba_hidden_act: {config['mamba_hidden_act']!r} is not supported (silu)")
    layers = nemotron_h_layers(config, source)
    kinds = config.get("layers_block_type") or list(config.get("hybrid_override_pattern"))
    ffn_kinds = {i: _NEMOTRON_H_BLOCKS[kinds[ffn]] for i, (_, _, ffn) in enumerate(layers) if ffn is not None}
    config = {**config, **{new: config[old] for old, new in _NEMOTRON_H_LEGACY_KEYS.items() if old in config}}
    expand = config.get("expand", 2)
    shape = {"num_layers": len(layers),
             "ssm_layers": tuple(i for i, (_, kind, _) in enumerate(layers) if kind == "mamba"),
             "mlp_free_layers": tuple(i for i in range(len(layers)) if i not in ffn_kinds),
             "partial_rotary_factor": 0.0, "gated_ffn": False}
    if "moe" in ffn_kinds.values():
        shape["dense_only_layers"] = tuple(i for i, kind in ffn_kinds.items() if kind == "mlp")
    else:  # HF's config holds its router's defaults whether or not a block is a mixture
        shape.update(num_experts=0, experts_per_token=0)
    keys = {"ssm_num_heads": "mamba_num_heads", "ssm_head_dim": "mamba_head_dim", "ssm_state_size": "ssm_state_size",
            "ssm_groups": "n_groups", "ssm_conv_kernel": "conv_kernel", "ssm_chunk_size": "chunk_size",
            "ssm_conv_bias": "use_conv_bias", "ssm_proj_bias": "mamba_proj_bias"}
    return {**shape, **_mamba2_shape(config, keys, expand, hidden, source)}


def _lfm2_fields(config: dict, source: str) -> dict:
    """LFM2: gated short convolutions ("conv" layers) beside attention layers, each with a SwiGLU whose width its
    config adjusts (block_auto_adjust_ff_dim: two thirds, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of), as HF's model builds it. LFM2-MoE: the same layers, a mixture of experts after all but the
    first num_dense_layers, whose SwiGLU is intermediate_size wide as it stands."""
    if config.get("use_expert_bias") is False:
        raise ValueError(f"{source}: use_expert_bias: LFM2-MoE's router without its expert bias is not supported")
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention" if i in (config.get("full_attn_idxs") or range(layers))
                                          else "conv" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"conv", "full_attention"}:
        raise ValueError(f"{source}: layer_types: {layers} of conv, full_attention expected, got {kinds}")
    width = config.get("intermediate_size", config.get("block_ff_dim"))
    if config["model_type"] == "lfm2" and config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if (multiplier := config.get("block_ffn_dim_multiplier", 1.0)) is not None:
            multiple = config.get("block_multiple_of", 256)
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return {"ssm_layers": tuple(i for i, kind in enumerate(kinds) if kind == "conv"), "state_mixer": "short_conv",
            "ssm_conv_kernel": int(config.get("conv_L_cache", 3)), "ssm_conv_bias": bool(config.get("conv_bias")),
            "intermediate_size": width}


# Qwen3.5's (dense and MoE; text_config's model types, and the wrappers') and Qwen3-Next's configs; those whose
# shared expert is gated (Qwen2-MoE's form)
_QWEN3_5 = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
_GATED_SHARED_EXPERT = ("qwen2_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def _qwen3_5_fields(config: dict, source: str) -> dict:
    """Qwen3.5 and Qwen3-Next: gated DeltaNet layers ("linear_attention") beside gated attention layers (every
    full_attention_interval-th, without layer_types) with a quarter of each head rotary, unless said otherwise."""
    layers = config["num_hidden_layers"]
    interval = config.get("full_attention_interval", 4)
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types: {layers} of linear_attention, full_attention expected, got "
                         f"{kinds}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return {"ssm_layers": tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
            "state_mixer": "gated_delta", "attention_output_gate": True, "ssm_conv_bias": False,
            "ssm_num_heads": config.get("linear_num_value_heads", 32),
            "ssm_head_dim": config.get("linear_value_head_dim", 128),
            "ssm_state_size": config.get("linear_key_head_dim", 128),
            "ssm_groups": config.get("linear_num_key_heads", 16),
            "ssm_conv_kernel": config.get("linear_conv_kernel_dim", 4),
            "partial_rotary_factor": float(config.get("partial_rotary_factor",
                                                      rope.get("partial_rotary_factor", 0.25)))}


# a Granite 4.0-H config's layer_types: HF's names for its two kinds, and the checkpoints' own
_GRANITE_LAYER_KINDS = {"mamba": True, "linear_attention": True, "attention": False, "full_attention": False}


def _granite_mamba_layers(config: dict, source: str) -> tuple[int, ...]:
    """The Mamba-2 layers of a granitemoehybrid config (HF's default, without layer_types: every layer)."""
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * layers
    if len(kinds) != layers or any(kind not in _GRANITE_LAYER_KINDS for kind in kinds):
        raise ValueError(f"{source}: layer_types: {layers} of {', '.join(_GRANITE_LAYER_KINDS)} expected, got "
                         f"{kinds}")
    return tuple(i for i, kind in enumerate(kinds) if _GRANITE_LAYER_KINDS[kind])


def _granite_moe_fields(config: dict, fields: dict, source: str) -> dict:
    """Granite's mixtures (granitemoe, granitemoeshared, granitemoehybrid): experts as wide as intermediate_size,
    an ungated shared MLP of shared_intermediate_size beside them (the whole FFN where there are no experts:
    Granite 4.0-H's dense models); Granite 4.0-H's attention without rotary (NoPE) unless position_embedding_type
    says rope."""
    kind = config.get("model_type")
    if kind not in ("granitemoe", "granitemoeshared", "granitemoehybrid"):
        return {}
    out: dict = {}
    shared = int(config.get("shared_intermediate_size") or 0)
    if fields.get("num_experts"):
        if shared:
            out.update(shared_expert_intermediate_size=shared, shared_experts=1)
    elif kind == "granitemoehybrid":
        out.update(intermediate_size=shared, num_experts=0, experts_per_token=0)
    if kind == "granitemoehybrid":
        positions = config.get("position_embedding_type")
        if positions not in (None, "nope", "rope"):
            raise ValueError(f"{source}: position_embedding_type: {positions!r} is not supported (rope, nope)")
        out["partial_rotary_factor"] = 1.0 if positions == "rope" else 0.0
    return out


def _refuse_minimax_variants(config: dict, source: str) -> None:
    """What MiniMax's checkpoints say that MiniMax-M2's layers do not do: linear (lightning) attention layers
    (MiniMax-01's and M1's attn_type_list 0), a shared expert, a routing other than sigmoid scores with the bias."""
    if config.get("model_type") != "minimax_m2":
        return
    if 0 in (config.get("attn_type_list") or ()):
        raise ValueError(f"{source}: attn_type_list: lightning (linear) attention layers are not supported")
    if config.get("shared_intermediate_size"):
        raise ValueError(f"{source}: shared_intermediate_size: a shared expert in minimax_m2 is not supported")
    for key, supported in (("scoring_func", "sigmoid"), ("use_routing_bias", True), ("qk_norm_type", "per_layer")):
        if config.get(key, supported) != supported:
            raise ValueError(f"{source}: {key}: {config[key]!r} is not supported for minimax_m2 ({supported!r})")


def _refuse_ernie_variants(config: dict, fields: dict, source: str) -> None:
    """Ernie 4.5's layouts ridge does not run, by name: biases on its projections, a renormalisation floor a top k's
    sum can reach, and experts on other than every layer from moe_layer_start_index to the last."""
    if not config.get("model_type", "").startswith("ernie4_5"):
        return
    if config.get("use_bias"):
        raise ValueError(f"{source}: use_bias: biases on Ernie 4.5's projections are not supported")
    experts, top_k = fields.get("num_experts") or 0, fields.get("experts_per_token") or 0
    floor = float(config.get("moe_norm_min") or 0.0)
    if experts and floor > top_k / experts:  # the top k's sum is never below k / experts: a lower floor changes nothing
        raise ValueError(f"{source}: moe_norm_min: a floor of {floor} on the top {top_k}'s sum above {top_k}/{experts} "
                         "is not supported (only a floor no sum reaches)")
    last = config.get("moe_layer_end_index", -1)
    if fields.get("num_experts") and (int(config.get("moe_layer_interval") or 1) != 1
                                      or last not in (-1, None, fields["num_layers"] - 1)):
        raise ValueError(f"{source}: moe_layer_interval / moe_layer_end_index: experts on every layer from "
                         "moe_layer_start_index to the last are supported, not another pattern")


def _llama4_fields(config: dict, fields: dict, source: str) -> dict:
    """Llama 4's text model (HF's defaults where its config leaves a key out): experts as wide as its
    intermediate_size on every interleave_moe_layer_step-th layer (moe_layers), one shared expert of that width, the
    other layers' FFN intermediate_size_mlp wide; NoPE on every fourth layer (no_rope_layers: 0 there), chunked
    attention (attention_chunk_size) on the others; q / k L2-normed where use_qk_norm; the NoPE layers' queries
    tempered (attn_temperature_tuning: attn_scale, floor_scale)."""
    if config.get("model_type") != "llama4_text":
        return {}
    layers = fields["num_layers"]
    step = int(config.get("interleave_moe_layer_step", 1))
    listed = config.get("moe_layers")
    moe = list(listed if listed is not None else range(step - 1, layers, step))
    out: dict = {"moe_intermediate_size": int(config.get("intermediate_size", 8192)),
                 "intermediate_size": int(config.get("intermediate_size_mlp", 16384)), "shared_experts": 1,
                 "num_experts": int(config.get("num_local_experts", 16)),
                 "experts_per_token": int(config.get("num_experts_per_tok", 1)),
                 "qk_l2_norm": bool(config.get("use_qk_norm", True))}
    if moe == list(range(step - 1, layers, step)):
        out["moe_layer_step"] = step
    else:
        out["dense_only_layers"] = tuple(i for i in range(layers) if i not in moe)
    interval = int(config.get("no_rope_layer_interval", 4))
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    out["nope_layers"] = tuple(i for i, turns in enumerate(rope) if not turns)
    if chunk := config.get("attention_chunk_size"):
        kinds = ["chunked_attention" if turns else "full_attention" for turns in rope]
        out.update(sliding_window=int(chunk), chunked_window=True, global_every=_global_every(kinds, source))
    if config.get("attn_temperature_tuning", True) and out["nope_layers"]:
        out["nope_temperature"] = (float(config.get("attn_scale", 0.1)), int(config.get("floor_scale", 8192)))
    return out


def _mlp_layer_types(config: dict) -> dict:
    """GLM-4.7-Flash's per-layer list of dense and sparse FFNs: its leading dense layers, as DeepSeek's
    first_k_dense_replace says them (what a GGUF header holds), or, dense layers elsewhere, Qwen's mlp_only_layers."""
    kinds = config.get("mlp_layer_types")
    if not kinds:
        return {}
    dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return {"first_dense_layers": len(dense)} if dense == tuple(range(len(dense))) else {"dense_only_layers": dense}


def _json_float(value: float | dict) -> float:
    """A number of an HF config.json: HF writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _global_every(layer_types: list[str], source: str) -> int:
    """Every n-th layer attends to all (the last of each run of n), the rest through the window: n; 0 when no
    layer attends to all."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not full:
        return 0
    every = full[0] + 1
    if full != list(range(every - 1, len(layer_types), every)):
        raise ValueError(f"{source}: layer_types: full attention at layers {full[:8]}..., not every n-th layer")
    return every


def _pattern_period(pattern: str, source: str) -> int:
    """A layer pattern's period, as "LLLG" says it (local layers, then the global one that closes each run)."""
    if not pattern or pattern.strip("L") != "G" or not pattern.endswith("G"):
        raise ValueError(f"{source}: sliding_window_pattern {pattern!r} is not local layers then one global ('LLLG')")
    return len(pattern)


def _global_layers(num_layers: int, every: int | None, source: str) -> tuple[int, ...]:
    """The layers that attend to all in a pattern of every-th global layers."""
    if not every:
        raise ValueError(f"{source}: sliding_window without a pattern of global layers (sliding_window_pattern)")
    return tuple(i for i in range(num_layers) if (i + 1) % every == 0)


COHERE2_GLOBAL_EVERY = 4  # llama.cpp's swa pattern for cohere2, fixed by the architecture
SMOLLM3_NOPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step for smollm3, fixed by the architecture


def _largest(read) -> int:
    """A header number that may be one per block (0 where a block has none): the largest."""
    return int(max(read)) if isinstance(read, list) else int(read)


def nemotron_h_block_kinds(num_layers: int, ssm_layers: tuple[int, ...], mlp_free_layers: tuple[int, ...],
                           dense_layers: tuple[int, ...] | None = None) -> list[str]:
    """ridge's layers of a Nemotron-H model as its blocks, in order (nemotron_h_layers' inverse): each layer's mixer
    block ("mamba" or "attention"), then its FFN block where it has one: "mlp", or, in a model with experts
    (dense_layers given: the layers whose FFN is dense), "moe" on the others."""
    kinds: list[str] = []
    for layer in range(num_layers):
        kinds.append("mamba" if layer in ssm_layers else "attention")
        if layer not in mlp_free_layers:
            kinds.append("mlp" if dense_layers is None or layer in dense_layers else "moe")
    return kinds


def decoder_layers(gguf: GGUFFile) -> int:
    """A GGUF model's decoder layers: its block count, less the multi-token prediction layers (Qwen3.5's) that
    llama.cpp's converter writes as blocks after them (`nextn_predict_layers`)."""
    arch = gguf.fields["general.architecture"]
    count = int(gguf.fields[f"{arch}.block_count"])
    return count - int(gguf.fields.get(f"{arch}.nextn_predict_layers", 0))


def gguf_value(gguf: GGUFFile, key: str, default=None):
    """A GGUF header field, a one-item list read as its item."""
    read = gguf.fields.get(key, default)
    return read[0] if isinstance(read, list) and len(read) == 1 else read


def spec_from_gguf(gguf: GGUFFile, name: str, source: str) -> ModelSpec:
    """A GGUF file's header (its `<arch>.*` keys and tensor table), without reading the tensors."""

    def value(key: str, default=None):
        return gguf_value(gguf, key, default)

    arch = value("general.architecture")
    heads = int(value(f"{arch}.attention.head_count"))
    hidden = int(value(f"{arch}.embedding_length"))
    shapes = {t.name: t.shape for t in gguf.tensors}  # in PyTorch's order
    tokens = value("tokenizer.ggml.tokens")
    vocab = (shapes["token_embd.weight"][0] if "token_embd.weight" in shapes
             else int(value(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0)))
    kv = value(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv, list):  # per layer (granitehybrid: 0 on its Mamba layers): the attention layers' count
        kv = max(kv)
    names = set(shapes)
    experts = int(value(f"{arch}.expert_count", 0))
    norm_topk = value(f"{arch}.expert_weights_norm", _GGUF_NORM_TOPK.get(arch))
    fields = dict(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=decoder_layers(gguf),
        num_heads=heads, num_kv_heads=int(kv),
        head_dim=int(value(f"{arch}.attention.key_length", hidden // heads if heads else 0)),
        intermediate_size=_largest(value(f"{arch}.feed_forward_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        num_experts=experts, experts_per_token=int(value(f"{arch}.expert_used_count", 0)),
        moe_intermediate_size=int(value(f"{arch}.expert_feed_forward_length", 0)),
        shared_expert_intermediate_size=int(value(f"{arch}.expert_shared_feed_forward_length", 0)),
        shared_experts=int(value(f"{arch}.expert_shared_count",
                                 any(n.endswith("ffn_gate_shexp.weight") for n in names))),
        shared_expert_gate="blk.0.ffn_gate_inp_shexp.weight" in names,
        qk_norm_params=next((shapes[n][0] + shapes[n.replace("attn_q_norm", "attn_k_norm")][0] for n in sorted(shapes)
                             if n.endswith("attn_q_norm.weight")), 0),
        norm_topk_prob=None if norm_topk is None else bool(norm_topk),
        sliding_window=int(value(f"{arch}.attention.sliding_window", 0)),
        global_every=_GGUF_GLOBAL_EVERY.get(arch, 0),
        source=source, architecture=_gguf_architecture(arch, experts, value),
        rms_norm_eps=float(value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(value(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(value(f"{arch}.context_length", 4096)),
        rope_scaling=_gguf_rope_scaling(gguf, arch, value),
        **_gguf_gemma_fields(arch, value, hidden, heads),
        **_gguf_granite_fields(arch, value),
    )
    fields.update(_gguf_deepseek_fields(arch, value, heads))
    fields.update(_gguf_sigmoid_router_fields(arch, value, fields["head_dim"]))
    if arch == "smollm3":  # llama.cpp's graph leaves every fourth layer without rotary; the file does not say it
        fields["nope_layers"] = tuple(i for i in range(fields["num_layers"]) if (i + 1) % SMOLLM3_NOPE_EVERY == 0)
    if arch == "seed_oss":
        fields["attention_out_bias"] = "blk.0.attn_output.bias" in names
    fields.update(_gguf_window_fields(arch, value, fields, source))
    fields.update(_gguf_llama4_fields(arch, value, fields))
    if arch in ("command-r", "cohere2"):  # LayerNorm's epsilon, and the logits' scale (Granite's divisor inverted)
        fields["rms_norm_eps"] = float(value(f"{arch}.attention.layer_norm_epsilon", 1e-5))
        fields["logits_scaling"] = 1 / float(value(f"{arch}.logit_scale", 1.0))
    if arch == "bert":  # llama.cpp's encoders: BERT's (and RoBERTa's, its position table cut to start at position 0)
        if value(f"{arch}.attention.causal", False):
            raise ValueError(f"{source}: bert.attention.causal: a causal BERT is not supported")
        if value("tokenizer.ggml.model") != "bert":  # RoBERTa's BPE, XLM-RoBERTa's unigram: their <s> ... </s>
            raise ValueError(f"{source}: tokenizer.ggml.model: a bert GGUF with a {value('tokenizer.ggml.model')!r} "
                             "vocabulary (RoBERTa's, XLM-RoBERTa's) is not supported; load the model's HF folder")
        fields.update(_ENCODER_SHAPE, rms_norm_eps=float(value(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
                      hidden_act="gelu",
                      type_vocab_size=shapes["token_types.weight"][0] if "token_types.weight" in shapes else 0)
        if "cls.weight" in names or "cls.output.weight" in names:
            raise ValueError(f"{source}: a reranker's classification head in a GGUF (llama.cpp's rank pooling) is not "
                             "supported; load the model's HF folder")
    if arch == "starcoder2":  # LayerNorm's epsilon, biases where the file has them, an ungated GELU-tanh MLP
        fields.update(rms_norm_eps=float(value(f"{arch}.attention.layer_norm_epsilon", 1e-5)),
                      attention_out_bias="blk.0.attn_output.bias" in names, mlp_bias="blk.0.ffn_up.bias" in names,
                      gated_ffn="blk.0.ffn_gate.weight" in names, hidden_act="gelu_tanh")
    if arch == "ernie4_5-moe":  # leading dense layers, then experts on every layer
        fields["first_dense_layers"] = int(value(f"{arch}.leading_dense_block_count", 0))
        if (step := int(value(f"{arch}.interleave_moe_layer_step", 1))) != 1:
            raise ValueError(f"{source}: {arch}.interleave_moe_layer_step: experts on every {step}-th layer are not "
                             "supported (1)")
    if arch in ("phi3", "glm4"):  # part of each head rotary: Phi-4-mini's three quarters, GLM-4's half
        fields["partial_rotary_factor"] = int(value(f"{arch}.rope.dimension_count", fields["head_dim"])) / fields[
            "head_dim"]
    fields.update(_gguf_gemma4_fields(gguf, arch, value, fields, names, source))
    fields.update(_gguf_state_space_fields(arch, value, names, fields["head_dim"]))
    fields.update(_gguf_nemotron_h_fields(arch, value, names, source))
    if fields["num_experts"] and not fields["moe_intermediate_size"]:  # Mixtral's, Granite's: as wide as the FFN
        fields["moe_intermediate_size"] = fields["intermediate_size"]
    return ModelSpec(**fields).validate()


def _gguf_llama4_fields(arch: str, value, fields: dict) -> dict:
    """A llama4 file's: llama.cpp's graph fixes what Llama 4's config says apart (LLAMA4_CHUNK-token chunks on 3 of
    4 layers, the fourth without rotary, its queries tempered LLAMA4_TEMPERATURE; q / k L2-normed unless the model
    has 128 experts, Maverick's), and a sliding_window key of 0 turns the chunks, NoPE and temperature off; the
    header holds the experts' layer step."""
    if arch != "llama4":
        return {}
    out = {"moe_layer_step": int(value(f"{arch}.interleave_moe_layer_step", 1)),
           "qk_l2_norm": fields["num_experts"] != 128}
    if value(f"{arch}.attention.sliding_window") == 0:
        return {**out, "sliding_window": 0}
    nope = tuple(i for i in range(fields["num_layers"]) if (i + 1) % 4 == 0)
    return {**out, "sliding_window": LLAMA4_CHUNK, "chunked_window": True, "global_every": 4, "nope_layers": nope,
            "nope_temperature": LLAMA4_TEMPERATURE}


def _gguf_window_fields(arch: str, value, fields: dict, source: str) -> dict:
    """The layers of an architecture that windows all but every n-th (the global ones), where its header has a window:
    OLMo-3's (olmo2; its windowed layers' rotary never scaled), and EXAONE 4's, K-EXAONE's and Command R7B's (their
    global layers turn no rotary). n is the header's pattern (a period, or each layer's flag), cohere2's fixed by
    llama.cpp."""
    if arch not in ("olmo2", "exaone4", "exaone-moe", "cohere2") or not fields["sliding_window"]:
        return {}
    pattern = COHERE2_GLOBAL_EVERY if arch == "cohere2" else value(f"{arch}.attention.sliding_window_pattern", 4)
    every = _global_every(["sliding_attention" if windowed else "full_attention" for windowed in pattern],
                          source) if isinstance(pattern, list) else int(pattern)
    if arch != "olmo2":
        return {"global_every": every, "nope_layers": _global_layers(fields["num_layers"], every, source)}
    local_theta = value(f"{arch}.rope.freq_base_swa")
    unscaled = fields["rope_scaling"] is not None or local_theta is not None
    return {"global_every": every, **({"rope_local_theta": float(local_theta if local_theta is not None
                                                                  else fields["rope_theta"])} if unscaled else {})}


def _gguf_rope_scaling(gguf: GGUFFile, arch: str, value) -> dict | None:
    """A GGUF header's rotary scaling in HF's keys. llama.cpp's converter writes linear and YaRN as keys, Llama
    3.1's scaling as the divisors themselves, a tensor of head_dim / 2 floats (read here: 256 bytes), and Phi-3's
    LongRoPE as two such tensors, its attention factor a key."""
    tensors = {t.name: t for t in gguf.tensors if t.name.startswith("rope_")}

    def floats(name: str) -> list[float]:
        return [float(v) for v in dequantize(tensors[name].data, tensors[name].tensor_type).reshape(-1)]

    if "rope_freqs.weight" in tensors:
        return {"rope_type": "llama3", "factor": 1.0, "frequency_divisors": floats("rope_freqs.weight")}
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE: both sets of divisors, and the attention factor
        scaling = {"rope_type": "longrope", "long_factor": floats("rope_factors_long.weight"),
                   "short_factor": floats("rope_factors_short.weight"),
                   "original_max_position_embeddings": int(value(f"{arch}.rope.scaling.original_context_length"))}
        if (factor := value(f"{arch}.rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(factor)
        return scaling
    kind = value(f"{arch}.rope.scaling.type", "none")
    scaling = ({"rope_type": "default"} if kind in ("none", None)
               else {"rope_type": str(kind), "factor": float(value(f"{arch}.rope.scaling.factor", 1.0))})
    for key, hf_key, cast in (("original_context_length", "original_max_position_embeddings", int),
                              ("yarn_beta_fast", "beta_fast", float), ("yarn_beta_slow", "beta_slow", float),
                              ("attn_factor", "gguf_attn_factor", float)):  # not HF's attention_factor: refused
        if (read := value(f"{arch}.rope.scaling.{key}")) is not None:
            scaling[hf_key] = cast(read)
    if arch == "gpt-oss":
        # gpt-oss's YaRN ramps between unrounded dims (OpenAI's reference, HF's config: truncate false); llama.cpp
        # rounds them outwards for every model, and so its rotary differs from the model's by a little
        scaling["truncate"] = False
    if (log_mul := value(f"{arch}.rope.scaling.yarn_log_multiplier")) is not None:
        if arch in ("deepseek2", "mistral4", "glm-dsa"):  # the converter writes 0.1 * mscale_all_dim, the graph
            # takes mscale = it
            scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
        elif arch == "mistral3":  # mscale_all_dim itself (1: no attention factor, as Ministral 3's mscale is 1 too)
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul)
        else:  # the key means something else for other architectures: refused by name
            scaling["gguf_yarn_log_multiplier"] = float(log_mul)
    if temperature := value(f"{arch}.attention.temperature_scale"):  # Ministral 3's llama_4_scaling_beta
        scaling["llama_4_scaling_beta"] = float(temperature)
        # its period: the original context, where the header does not give its own (llama.cpp's reading)
        period = value(f"{arch}.attention.temperature_length") or scaling.get("original_max_position_embeddings")
        scaling["temperature_length"] = int(period or value(f"{arch}.context_length"))
    return None if scaling == {"rope_type": "default"} else scaling


def _gguf_architecture(arch: str, experts: int, value) -> str:
    """ridge's name for a GGUF architecture where llama.cpp's covers several: a llama with experts is a Mixtral,
    and a deepseek2 with sigmoid gates (llama.cpp's gating function 2) is DeepSeek-V3, with softmax ones V2."""
    if arch == "llama" and experts:
        return "mixtral"
    if arch == "deepseek2":
        gating = int(value(f"{arch}.expert_gating_func", 1))
        if gating not in (1, 2):
            raise ValueError(f"{arch}.expert_gating_func: {gating} is not supported (1: softmax, DeepSeek-V2; "
                             "2: sigmoid, DeepSeek-V3)")
        return "deepseek_v3" if gating == 2 else "deepseek_v2"
    if arch == "mistral4" and (gating := int(value(f"{arch}.expert_gating_func", 1))) != 1:
        raise ValueError(f"{arch}.expert_gating_func: {gating} is not supported for {arch} (1: softmax)")
    if arch == "glm-dsa":  # GLM-5: DeepSeek-V3's layers with sparse attention
        if (gating := int(value(f"{arch}.expert_gating_func", 2))) != 2:
            raise ValueError(f"{arch}.expert_gating_func: {gating} is not supported for {arch} (2: sigmoid)")
        return "glm_moe_dsa"
    return arch


def _gguf_deepseek_fields(arch: str, value, heads: int) -> dict:
    """A deepseek2 file's latent attention and router. llama.cpp's converter (since mid-2025) writes the
    attention as one KV head of the latent: key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank,
    and the per-head widths in key_length_mla / value_length_mla; older files have the per-head widths in
    key_length / value_length. Rotary dims stay in the checkpoint's interleaved pairs (llama.cpp's "norm" rope)."""
    if arch not in ("deepseek2", "mistral4", "glm-dsa"):  # Mistral 4's and GLM-5's: deepseek2's keys under their names
        return {}
    rope = int(value(f"{arch}.rope.dimension_count"))
    key, val = value(f"{arch}.attention.key_length_mla"), value(f"{arch}.attention.value_length_mla")
    if key is None:
        key, val = value(f"{arch}.attention.key_length"), value(f"{arch}.attention.value_length")
    groups = int(value(f"{arch}.expert_group_count", 1))
    sigmoid = int(value(f"{arch}.expert_gating_func", 2 if arch == "glm-dsa" else 1)) == 2
    indexer = _gguf_indexer_fields(arch, value) if arch == "glm-dsa" else {}
    return {**indexer, "num_kv_heads": heads, "head_dim": rope,
            "kv_lora_rank": int(value(f"{arch}.attention.kv_lora_rank")),
            "q_lora_rank": int(value(f"{arch}.attention.q_lora_rank", 0)), "qk_rope_head_dim": rope,
            "qk_nope_head_dim": int(key) - rope, "v_head_dim": int(val),
            "first_dense_layers": int(value(f"{arch}.leading_dense_block_count", 0)),
            "shared_experts": int(value(f"{arch}.expert_shared_count", 0)),
            "norm_topk_prob": bool(value(f"{arch}.expert_weights_norm", False)),
            "routed_scaling_factor": float(value(f"{arch}.expert_weights_scale", 1.0)),
            "router_groups": groups, "router_topk_groups": int(value(f"{arch}.expert_group_used_count", 1)),
            "router_topk_method": "" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
            "rope_interleave": True, "qkv_bias": False}


# llama.cpp reads a glm-dsa file of this context or more without indexer types as GLM-5.2's, most of whose layers reuse
# another layer's choice of keys
GLM_DSA_SHARED_INDEXER_CONTEXT = 1_048_576


def _gguf_indexer_fields(arch: str, value) -> dict:
    """A glm-dsa file's sparse-attention indexer; layers that reuse another layer's choice (an indexer type of 0,
    or llama.cpp's reading of a long-context file that lists none) refused by name."""
    kinds = value(f"{arch}.attention.indexer.types")
    if kinds is None and int(value(f"{arch}.context_length", 0)) >= GLM_DSA_SHARED_INDEXER_CONTEXT:
        raise ValueError(f"{arch}.attention.indexer.types: none in a file of {GLM_DSA_SHARED_INDEXER_CONTEXT:,}+ "
                         "tokens of context, which llama.cpp reads as GLM-5.2's layers that reuse another layer's "
                         "choice of keys; those are not supported")
    if kinds is not None and not all(kinds if isinstance(kinds, list) else [kinds]):
        raise ValueError(f"{arch}.attention.indexer.types: layers that reuse another layer's choice of keys (0) are "
                         "not supported (every layer 1: its own indexer)")
    return {"index_topk": int(value(f"{arch}.attention.indexer.top_k")),
            "index_heads": int(value(f"{arch}.attention.indexer.head_count")),
            "index_head_dim": int(value(f"{arch}.attention.indexer.key_length"))}


def _gguf_sigmoid_router_fields(arch: str, value, head_dim: int) -> dict:
    """A glm4moe, minimax-m2, dots1 or exaone-moe file's router (DeepSeek-V3's: sigmoid scores chosen with the
    correction bias, the chosen ones' weights scaled), leading dense layers and rotary part of each head."""
    if arch not in ("glm4moe", "minimax-m2", "dots1", "exaone-moe", "nemotron_h_moe"):
        return {}
    if (gating := int(value(f"{arch}.expert_gating_func", 2))) != 2:
        raise ValueError(f"{arch}.expert_gating_func: {gating} is not supported for {arch} (2: sigmoid)")
    return {"first_dense_layers": int(value(f"{arch}.leading_dense_block_count", 0)),
            "routed_scaling_factor": float(value(f"{arch}.expert_weights_scale", 1.0)),
            "router_groups": int(value(f"{arch}.expert_group_count", 1)),
            "router_topk_groups": int(value(f"{arch}.expert_group_used_count", 1)),
            "partial_rotary_factor": int(value(f"{arch}.rope.dimension_count", head_dim)) / head_dim}


def _gguf_state_space_fields(arch: str, value, names: set[str], head_dim: int) -> dict:
    """A mamba2 file's mixers, as llama.cpp's converter writes them: every layer one, no FFN; its heads are the
    time_step_rank (a dt per head), the residual stream float32 (llama.cpp's graph adds in float32). A
    granitehybrid file's (Granite 4.0-H, Bamba): the layers whose KV head count is 0, beside attention (without
    rotary, or Bamba's on part of each head) and an FFN on every layer. An lfm2 (lfm2moe) file's short
    convolutions: likewise, their taps in shortconv.l_cache (and LFM2-MoE's leading dense layers)."""
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        return _gguf_qwen3_5_fields(arch, value, head_dim)
    if arch in ("lfm2", "lfm2moe"):
        if (scale := value(f"{arch}.expert_weights_scale", 1.0)) != 1.0:  # llama.cpp's graph applies none
            raise ValueError(f"{arch}.expert_weights_scale: {scale} is not supported for {arch} (1)")
        return {"ssm_layers": _layers_without_kv(arch, value), "state_mixer": "short_conv",
                "ssm_conv_kernel": int(value(f"{arch}.shortconv.l_cache")),
                "ssm_conv_bias": any(n.endswith("shortconv.conv.bias") for n in names),
                "first_dense_layers": int(value(f"{arch}.leading_dense_block_count", 0))}
    if arch not in ("mamba2", "granitehybrid"):
        return {}
    heads, inner = int(value(f"{arch}.ssm.time_step_rank")), int(value(f"{arch}.ssm.inner_size"))
    mixers = {"ssm_num_heads": heads, "ssm_head_dim": inner // heads,
              "ssm_state_size": int(value(f"{arch}.ssm.state_size")),
              "ssm_groups": int(value(f"{arch}.ssm.group_count", 1)),
              "ssm_conv_kernel": int(value(f"{arch}.ssm.conv_kernel")),
              "ssm_conv_bias": "blk.0.ssm_conv1d.bias" in names}
    if arch == "mamba2":
        return {"ssm_layers": tuple(range(int(value(f"{arch}.block_count")))), "has_ffn": False,
                "num_heads": 0, "num_kv_heads": 0, "head_dim": 0, "intermediate_size": 0,
                "residual_in_fp32": True, **mixers}
    # rotary switched on (Bamba: on the first rope.dimension_count dims of each head) or off (Granite 4.0-H)
    rotary = int(value(f"{arch}.rope.dimension_count", head_dim)) if value(f"{arch}.rope.scaling.finetuned") else 0
    return {"ssm_layers": _layers_without_kv(arch, value), "partial_rotary_factor": rotary / head_dim, **mixers}


def gguf_nemotron_h_kinds(arch: str, value, names: set[str]) -> list[str]:
    """A nemotron_h (nemotron_h_moe) file's blocks, as llama.cpp tells them: attention where the block's KV head
    count is not 0, a Mamba-2 mixer where it and the FFN width are 0, else an FFN: a mixture where the block has a
    router (ffn_gate_inp), an MLP otherwise."""
    kv, ffn = value(f"{arch}.attention.head_count_kv"), value(f"{arch}.feed_forward_length")
    blocks = int(value(f"{arch}.block_count"))
    kv, ffn = (read if isinstance(read, list) else [read] * blocks for read in (kv, ffn))
    return ["attention" if heads else "mamba" if not width else "moe" if f"blk.{b}.ffn_gate_inp.weight" in names
            else "mlp" for b, (heads, width) in enumerate(zip(kv, ffn, strict=True))]


def _gguf_nemotron_h_fields(arch: str, value, names: set[str], source: str) -> dict:
    """A nemotron_h file's blocks read as ridge's layers (nemotron_h_layers), its Mamba-2 mixers' keys as
    granitehybrid's (_gguf_state_space_fields), attention without rotary, squared-ReLU MLPs."""
    if arch not in ("nemotron_h", "nemotron_h_moe"):
        return {}
    kinds = gguf_nemotron_h_kinds(arch, value, names)
    layers = nemotron_h_layers({"layers_block_type": kinds}, source)
    mixture = {"dense_only_layers": tuple(i for i, (_, _, ffn) in enumerate(layers)
                                          if ffn is not None and kinds[ffn] == "mlp")} if "moe" in kinds else {}
    heads, inner = int(value(f"{arch}.ssm.time_step_rank")), int(value(f"{arch}.ssm.inner_size"))
    return {"num_layers": len(layers), "ssm_layers": tuple(i for i, (_, kind, _) in enumerate(layers)
                                                           if kind == "mamba"),
            "mlp_free_layers": tuple(i for i, (_, _, ffn) in enumerate(layers) if ffn is None),
            "partial_rotary_factor": 0.0, "gated_ffn": False, "hidden_act": "relu2",
            "rms_norm_eps": float(value(f"{arch}.attention.layer_norm_epsilon", 1e-5)),
            "ssm_num_heads": heads, "ssm_head_dim": inner // heads,
            "ssm_state_size": int(value(f"{arch}.ssm.state_size")),
            "ssm_groups": int(value(f"{arch}.ssm.group_count", 1)),
            "ssm_conv_kernel": int(value(f"{arch}.ssm.conv_kernel")),
            "ssm_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in names), **mixture}


def _gguf_qwen3_5_fields(arch: str, value, head_dim: int) -> dict:
    """A qwen35 (qwen35moe, qwen3next) file's gated DeltaNet layers, as llama.cpp's converter writes them: all but
    every full_attention_interval-th; the value heads (time_step_rank) in llama.cpp's tiled order (qwen3next's in
    HF's grouped one), their width the inner size over them, the query / key heads the group count, their width the
    state size."""
    layers, interval = int(value(f"{arch}.block_count")) - int(value(f"{arch}.nextn_predict_layers", 0)), \
        int(value(f"{arch}.full_attention_interval", 4))
    heads, inner = int(value(f"{arch}.ssm.time_step_rank")), int(value(f"{arch}.ssm.inner_size"))
    return {"ssm_layers": tuple(i for i in range(layers) if (i + 1) % interval), "state_mixer": "gated_delta",
            "attention_output_gate": True, "ssm_num_heads": heads, "ssm_head_dim": inner // heads,
            "ssm_state_size": int(value(f"{arch}.ssm.state_size")),
            "ssm_groups": int(value(f"{arch}.ssm.group_count")),
            "ssm_conv_kernel": int(value(f"{arch}.ssm.conv_kernel")), "ssm_conv_bias": False,
            "ssm_heads_tiled": arch != "qwen3next",
            "partial_rotary_factor": int(value(f"{arch}.rope.dimension_count", head_dim)) / head_dim}


def _layers_without_kv(arch: str, value) -> tuple[int, ...]:
    """A hybrid's state-space layers, as llama.cpp's converter marks them: a KV head count of 0 in the per-layer
    list (one count for all: no such layer)."""
    per_layer = value(f"{arch}.attention.head_count_kv")
    per_layer = per_layer if isinstance(per_layer, list) else [per_layer] * int(value(f"{arch}.block_count"))
    return tuple(i for i, kv in enumerate(per_layer) if kv == 0)


def _gguf_granite_fields(arch: str, value) -> dict:
    """Granite's scalars, as llama.cpp's converter writes them (its mixtures' and hybrids' too)."""
    if arch not in ("granite", "granitemoe", "granitehybrid"):
        return {}
    scale = value(f"{arch}.attention.scale")
    return {"embedding_multiplier": float(value(f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(value(f"{arch}.residual_scale", 1.0)),
            "attention_multiplier": None if scale is None else float(scale),
            "logits_scaling": float(value(f"{arch}.logit_scale", 1.0))}


# whether a GGUF mixture renormalises its top-k routing weights, where the file does not say (llama.cpp's graphs)
_GGUF_NORM_TOPK = {"qwen3moe": True, "qwen3vlmoe": True, "qwen2moe": False, "olmoe": False, "granitemoe": True,
                   "granitehybrid": True, "lfm2moe": True, "qwen35moe": True, "qwen3next": True, "glm4moe": False,
                   "minimax-m2": True}

# the local:global pattern of a GGUF architecture, fixed by it and not stored (as llama.cpp has it): gpt-oss's
# windowed layers are the even ones, as its configs' layer_types list them
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's gemma3 graph's (its files do not say it)
_GGUF_GLOBAL_EVERY = {"gemma2": 2, "gemma3": GEMMA3_GLOBAL_EVERY, "gpt-oss": 2}


def _gguf_gemma4_fields(gguf: GGUFFile, arch: str, value, fields: dict, names: set[str], source: str) -> dict:
    """A gemma4 file's (llama.cpp's converter): the windowed layers' heads under the _swa keys and the global
    ones' under the plain keys, KV heads (and FFN widths, where the KV-shared layers' MLPs are double) per layer,
    each layer's kind as a flag, the global rotary's unturned pairs as divisors of 1e30 in rope_freqs (not Llama
    3.1's scaling), and a global layer's values its keys' projection where it has no attn_v."""
    if arch != "gemma4":
        return {}
    layers = fields["num_layers"]
    windowed = value(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(windowed, list) or len(windowed) != layers:
        raise ValueError(f"{source}: {arch}.attention.sliding_window_pattern: one flag per layer expected")
    every = _global_every(["sliding_attention" if w else "full_attention" for w in windowed], source)
    local, glob = windowed.index(True), windowed.index(False)
    kv = value(f"{arch}.attention.head_count_kv", fields["num_heads"])
    kv_local, kv_global = (int(kv[local]), int(kv[glob])) if isinstance(kv, list) else (int(kv), int(kv))
    widths = value(f"{arch}.feed_forward_length")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    shared = int(value(f"{arch}.attention.shared_kv_layers", 0))
    divisors = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    turning = 1.0
    if divisors is not None:  # 1 where a pair turns, 1e30 where it stays still (its frequency / 1e30: none)
        values = dequantize(divisors.data, divisors.tensor_type).reshape(-1)
        turning = float((values < 1e29).sum()) / len(values)
    for key, width in (("rope.dimension_count", value(f"{arch}.attention.key_length")),
                       ("rope.dimension_count_swa", value(f"{arch}.attention.key_length_swa"))):
        if (turned := value(f"{arch}.{key}", width)) != width:  # ridge turns whole heads, the rope_freqs' share of them
            raise ValueError(f"{source}: {arch}.{key}: {turned}, a rotary narrower than the head ({width}), is not "
                             "supported")
    return {"head_dim": int(value(f"{arch}.attention.key_length_swa")),
            "global_head_dim": int(value(f"{arch}.attention.key_length")),
            "num_kv_heads": kv_local, "global_kv_heads": kv_global if kv_global != kv_local else 0,
            "global_values_from_keys": f"blk.{glob}.attn_v.weight" not in names,
            "global_every": every, "kv_shared_layers": shared,
            "intermediate_size": widths[0], "double_wide_shared_mlp": widths[-1] == 2 * widths[0] and shared > 0,
            "per_layer_input_size": int(value(f"{arch}.embedding_length_per_layer_input", 0)),
            "moe_beside_mlp": fields["num_experts"] > 0, "rope_scaling": None, "global_rotary_fraction": turning,
            "rope_local_theta": float(value(f"{arch}.rope.freq_base_swa", 10000.0)), "hidden_act": "gelu_tanh",
            **({"final_logit_softcap": float(cap)} if (cap := value(f"{arch}.final_logit_softcapping")) else {})}


def _gguf_gemma_fields(arch: str, value, hidden: int, heads: int) -> dict:
    """What llama.cpp knows of Gemma 1, 2 and 3 by architecture: GeGLU, the local layers' rotary base, and the 27B
    models' attention scale from hidden / heads (head_dim elsewhere)."""
    if arch not in ("gemma", "gemma2", "gemma3"):
        return {}
    layers = int(value(f"{arch}.block_count"))
    big = layers == {"gemma2": 46, "gemma3": 62}.get(arch)
    softcaps = {f"{kind}_logit_softcap": float(cap) for kind in ("attn", "final")
                if (cap := value(f"{arch}.{kind}_logit_softcapping")) is not None}
    return {"hidden_act": "gelu_tanh", "query_pre_attn_scalar": hidden / heads if big else None,
            "rope_local_theta": 10000.0 if arch == "gemma3" else None, **softcaps}


