"""Architecture name -> the ModelConfig fields that make it what it is.

llama, mistral, ministral3, granite, qwen2, qwen3, smollm3, seed_oss, phi3, olmo2, olmo3, exaone4, glm4, ernie4_5,
cohere, cohere2, gemma, gemma2, gemma3, gemma4, the mixtures of experts mixtral, qwen2_moe, qwen3_moe, olmoe,
granitemoe, deepseek_v2, deepseek_v3 (and its sparse-attention forms deepseek_v32 and glm_moe_dsa), mistral4,
llama4, glm4_moe, dots1, exaone_moe, minimax_m2 and ernie4_5_moe, the state-space mamba2, bamba, nemotron_h and
granitemoehybrid, lfm2 and lfm2_moe, and qwen3_5, qwen3_5_moe and qwen3_next run on one DecoderModel; what differs
is a bias here, a norm there (or none before a sublayer, or a LayerNorm), attention and the MLP side by side (or no
MLP), Granite's scalars, queries sharpened by position, a sliding or chunked window, a layer without rotary, Gemma's
GeGLU or a squared ReLU, scaled embeddings and sandwich norms, layers of their own head widths, KV shared between
layers and per-layer embeddings (Gemma 4), an MoE block (with its router's variant) in place of the dense FFN, an
indexer choosing the keys latent attention reads, and a Mamba-2 mixer, LFM2's short convolution or Qwen3.5's gated
DeltaNet in place of attention; and the encoders bert (RoBERTa's and XLM-RoBERTa's too): attention to the whole
sequence, post-norms and learned positions.
"""

from __future__ import annotations

from typing import Any

from ridge.config import ModelConfig
from ridge.models.spec import ModelSpec
from ridge.rope_scaling import AttentionTemperature, RopeScaling

_QWEN3_5 = {"qk_norm": True, "norm_weight_offset": 1.0, "attention_output_gate": True}
# per architecture: fixed ModelConfig fields
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},  # llama with a sliding window on every layer (from its config)
    # Ministral 3 (3B / 8B / 14B, the language model of Mistral3ForConditionalGeneration): llama with YaRN and the
    # queries sharpened past the original context (its rope_parameters' llama_4_scaling_beta)
    "ministral3": {},
    "granite": {},  # llama with scalars on the embeddings, the residual branches, the scores and the logits
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "smollm3": {},  # llama with every fourth layer's attention unturned (NoPE: its config's no_rope_layers)
    "seed_oss": {},  # llama with q / k / v biases, and o_proj's where its config's attention_out_bias says
    "phi3": {},  # Phi-3 / Phi-4: llama with q / k / v and gate / up stored fused, LongRoPE, part of each head rotary
    # OLMo-2: no pre-norms, the attention's and the MLP's outputs normed before they join the residual; q and k normed
    # over all their heads (OLMoE's). OLMo-3: the same, with 3 of 4 layers windowed (their rotary never scaled)
    "olmo2": {"qk_norm_full": True, "sandwich_norms": True, "pre_norms": False},
    "olmo3": {"qk_norm_full": True, "sandwich_norms": True, "pre_norms": False},
    # EXAONE 4: OLMo-2's norms with q and k normed per head; windows on 3 of 4 layers, the global ones without rotary
    "exaone4": {"qk_norm": True, "sandwich_norms": True, "pre_norms": False},
    # GLM-4 (the 0414 models): pre-norms and sandwich norms, q / k / v biases, half of each head rotary in interleaved
    # pairs (reordered to halves at load)
    "glm4": {"sandwich_norms": True, "rope_interleave": True},
    # Ernie 4.5: llama with every head's rotary in interleaved pairs; its mixture (Ernie-4.5-21B-A3B) softmax scores
    # chosen with a per-expert bias, the top k renormalised, beside shared experts, after a leading dense layer
    "ernie4_5": {"rope_interleave": True},
    "ernie4_5_moe": {"rope_interleave": True, "norm_topk_prob": True, "router_choice_bias": True},
    # Command R (cohere) and Command R7B / Command A (cohere2): LayerNorm without a bias, attention and the MLP side
    # by side on one normed input, rotary in interleaved pairs, the logits scaled; cohere2's windows on 3 of 4
    # layers, the global ones without rotary
    # (Command R+'s use_qk_norm: a LayerNorm over each head of q and of k, each head its own weight)
    "cohere": {"norm_kind": "layer", "parallel_block": True, "rope_interleave": True},
    "cohere2": {"norm_kind": "layer", "parallel_block": True, "rope_interleave": True},
    # LayerNorms with biases, biased projections and an ungated GELU-tanh MLP (spec.py's _starcoder2_fields)
    "starcoder2": {"norm_kind": "layer", "norm_bias": True},
    "gemma": {"embedding_scale": True, "norm_weight_offset": 1.0},  # Gemma 1, CodeGemma: GeGLU (its config's)
    "gemma2": {"embedding_scale": True, "sandwich_norms": True, "norm_weight_offset": 1.0},
    "gemma3": {"embedding_scale": True, "sandwich_norms": True, "norm_weight_offset": 1.0, "qk_norm": True},
    # Gemma 4: Gemma 3's layer with norms that multiply by w itself, v normed too (without a weight), scores unscaled
    # and each layer's output times a scalar; its global layers' own head width and KV heads (their values the keys
    # where attention_k_eq_v) and proportional rotary, and the E models' per-layer embeddings and KV sharing
    # (models/spec.py's _gemma4_fields)
    "gemma4": {"embedding_scale": True, "sandwich_norms": True, "qk_norm": True, "value_norm": True,
               "layer_scalars": True, "attention_multiplier": 1.0, "norm_topk_prob": True,
               "router_normed_input": True, "router_expert_scales": True},
    # mixtures of experts (models/moe.py)
    "mixtral": {"norm_topk_prob": True},  # mistral's attention; its router always renormalises the top k
    "qwen2_moe": {"qkv_bias": True},  # its shared expert gated (the spec's shared_expert_gate)
    "qwen3_moe": {"qk_norm": True},
    "olmoe": {"qk_norm_full": True},
    # Granite's mixtures: Granite's scalars, a softmax over the top k logits (norm_topk_prob's renormalised top k),
    # and an ungated shared MLP where the config gives it a width (granitemoeshared's)
    "granitemoe": {"norm_topk_prob": True},
    # gpt-oss: attention sinks, alternating 128-token windows (from its layer_types), biases on every projection
    # (o_proj's with q / k / v's, attention_bias) and on the router's logits, clamped SwiGLU experts, and a
    # softmax over the top k logits (norm_topk_prob's renormalised top k of the softmax)
    "gpt_oss": {"attention_sinks": True, "expert_bias": True, "router_logit_bias": True, "hidden_act": "swiglu_oai",
                "norm_topk_prob": True},
    # latent attention (models/mla.py) and DeepSeek's routers (models/moe.py): V2's softmax one (greedy, or
    # limited to the groups of the best single scores), V3's sigmoid one (Kimi K2's too); V2's checkpoints always
    # interleave their rotary dims (HF's V2 rotates complex pairs), V3's say so in their config
    "deepseek_v2": {"rope_interleave": True, "router_group_rating": "max"},
    "deepseek_v3": {"router_scoring": "sigmoid", "router_choice_bias": True},
    # DeepSeek-V3.2 and GLM-5: DeepSeek-V3 with sparse attention (models/sparse_index.py), whose indexer turns its
    # rotary in halves (V3.2's) or in interleaved pairs (GLM-5's, reordered at load)
    "deepseek_v32": {"router_scoring": "sigmoid", "router_choice_bias": True},
    "glm_moe_dsa": {"router_scoring": "sigmoid", "router_choice_bias": True, "index_rope_interleave": True},
    # Mistral 4 (Mistral Small 4): DeepSeek-V3's latent attention and layout, its router's groups rated by their two
    # best softmax scores (no correction bias), and Ministral 3's attention temperature
    "mistral4": {},
    # Llama 4 (Scout, Maverick): llama attention turning every head's rotary in interleaved pairs, chunked windows on
    # the rotary layers and q / k L2-normed there, every fourth layer global without rotary, its queries tempered; a
    # sigmoid router whose chosen expert reads its token times the score, beside a shared expert (models/spec.py's
    # _llama4_fields reads the rest)
    "llama4": {"rope_interleave": True, "router_scoring": "sigmoid", "router_scales_input": True},
    # GLM-4.5 / 4.6 / 4.7: llama attention (q / k / v biases, half of each head rotary, per-head q / k norms where
    # its config has use_qk_norm) beside DeepSeek-V3's sigmoid router, shared experts and leading dense layers
    "glm4_moe": {"router_scoring": "sigmoid", "router_choice_bias": True},
    # dots.llm1 (rednote): Qwen3's attention (q / k normed per head) beside DeepSeek-V3's sigmoid router, shared
    # experts and leading dense layers
    "dots1": {"qk_norm": True, "router_scoring": "sigmoid", "router_choice_bias": True},
    # K-EXAONE (exaone_moe): EXAONE 4's attention (q / k normed per head, windows on 3 of 4 layers, the global ones
    # without rotary) with pre-norms, beside DeepSeek-V3's router, a shared expert and leading dense layers
    "exaone_moe": {"qk_norm": True, "router_scoring": "sigmoid", "router_choice_bias": True},
    # MiniMax-M2: q and k normed over all their heads (OLMoE's), part of each head rotary; sigmoid scores chosen
    # with the correction bias, no groups, no shared expert, the top k renormalised
    "minimax_m2": {"qk_norm_full": True, "router_scoring": "sigmoid", "router_choice_bias": True,
                   "norm_topk_prob": True},
    # state-space layers (models/mamba.py): Mamba-2's own models, and Bamba's hybrid of Mamba-2 layers and llama
    # attention layers (rotary on half of each head, as HF transformers fixes it), each followed by a SwiGLU FFN
    "mamba2": {},
    "bamba": {"partial_rotary_factor": 0.5},
    # Nemotron-H (Nemotron Nano 2, Nemotron 3): blocks of one sublayer each, read as layers of a Mamba-2 mixer or
    # attention without rotary with the squared-ReLU MLP (or mixture) that follows it, where one does (spec.py)
    "nemotron_h": {"router_scoring": "sigmoid", "router_choice_bias": True},  # its mixture: DeepSeek-V3's router
    # Granite 4.0-H: Granite's mixture (or a dense FFN) on every layer, most layers Mamba-2, the rest attention
    # without rotary (NoPE, partial_rotary_factor 0 from its config)
    "granitemoehybrid": {"norm_topk_prob": True},
    # LFM2: gated short convolutions (models/short_conv.py) beside attention with per-head q / k norms, a SwiGLU
    # after every layer
    "lfm2": {"qk_norm": True},
    # LFM2-MoE: LFM2's layers with a mixture after the first few: sigmoid scores, chosen with the expert bias
    # (DeepSeek-V3's router without groups), the top k renormalised with 1e-6 added to their sum
    "lfm2_moe": {"qk_norm": True, "router_scoring": "sigmoid", "router_choice_bias": True, "router_norm_eps": 1e-6},
    # Qwen3.5: gated DeltaNet layers (models/gated_delta.py) beside attention whose output is gated, q / k normed
    # per head; every norm but the DeltaNet's own multiplies by 1 + w. Qwen3.5-MoE and Qwen3-Next: a mixture with a
    # gated shared expert (Qwen2-MoE's) after every layer
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": {**_QWEN3_5, "norm_topk_prob": True},
    "qwen3_next": _QWEN3_5,
    # BERT, RoBERTa, XLM-RoBERTa (the encoders of bge, e5, MiniLM, gte-base...): every token attends to the whole
    # sequence; LayerNorms with biases after each sublayer joins the stream (post-norms), learned absolute positions
    # and token types under a LayerNorm, biased projections, an ungated GELU MLP (spec.py's _encoder_fields)
    "bert": {"causal": False, "post_norms": True, "norm_kind": "layer", "norm_bias": True, "learned_positions": True},
}
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "granitemoe",
        "granitemoehybrid", "lfm2_moe", "qwen3_5_moe", "qwen3_next", "glm4_moe", "minimax_m2", "ernie4_5_moe",
        "mistral4", "llama4", "dots1", "exaone_moe", "nemotron_h", "deepseek_v32", "glm_moe_dsa", "gemma4")
_OPTIONAL_QK_NORM = ("glm4_moe", "cohere")  # per-head q / k norms where the checkpoint has them (use_qk_norm)
_MLA = ("deepseek_v2", "deepseek_v3", "mistral4", "deepseek_v32", "glm_moe_dsa")
_SPARSE_ATTENTION = ("deepseek_v32", "glm_moe_dsa")  # an indexer picks the keys latent attention reads
# DeepSeek-V2's topk_method -> whether its router searches within groups
_V2_TOPK_METHODS = {"greedy": False, "group_limited_greedy": True}
_SSM = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
# routers whose top k weights always sum to 1, whatever a config's norm_topk_prob says
_ALWAYS_RENORMALISED = ("mixtral", "gpt_oss", "granitemoe", "granitemoehybrid", "qwen3_5_moe", "minimax_m2",
                        "ernie4_5_moe", "gemma4")
_GRANITE = ("granite", "granitemoe", "granitemoehybrid")  # Granite's scalars
_OUT_BIAS = ("llama", *_GRANITE, "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next", "smollm3")

# HF `architectures[0]` / `model_type` -> our name
_HF_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "ministral3",
    "Mistral4ForCausalLM": "mistral4",
    "Llama4ForConditionalGeneration": "llama4",  # its language model; the vision tower is not loaded
    "Llama4ForCausalLM": "llama4",
    "llama4_text": "llama4",  # its text config's model_type
    "mistral4": "mistral4",  # GGUF general.architecture too
    "mistral3": "ministral3",  # GGUF general.architecture (llama.cpp's name for Ministral 3's language model)
    "GraniteForCausalLM": "granite",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "SeedOssForCausalLM": "seed_oss",
    "Phi3ForCausalLM": "phi3",  # Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini
    "phi3": "phi3",  # GGUF general.architecture too
    "seed_oss": "seed_oss",  # GGUF general.architecture too
    "smollm3": "smollm3",  # GGUF general.architecture too
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "Glm4ForCausalLM": "glm4",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "Starcoder2ForCausalLM": "starcoder2",
    "command-r": "cohere",  # GGUF general.architecture
    "cohere2": "cohere2",  # GGUF general.architecture too
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "ernie4_5": "ernie4_5",  # GGUF general.architecture too
    "ernie4_5-moe": "ernie4_5_moe",  # GGUF general.architecture
    "glm4": "glm4",  # GGUF general.architecture too
    "exaone4": "exaone4",  # GGUF general.architecture too
    "olmo2": "olmo2",  # GGUF general.architecture: OLMo-3's too (its windows in the header)
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model; the vision tower is not loaded
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its language model; the vision and audio towers are not loaded
    "gemma4_text": "gemma4",
    # (a masked LM's head unread; a sequence classifier's read: a cross-encoder)
    **dict.fromkeys([f"{family}{kind}" for family in ("Bert", "Roberta", "XLMRoberta")
                     for kind in ("Model", "ForMaskedLM", "ForSequenceClassification")]
                    + ["bert", "roberta", "xlm-roberta"], "bert"),
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "deepseek_v3",  # GLM-4.7-Flash: DeepSeek-V3's latent attention and router
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",  # GLM-5
    "glm-dsa": "glm_moe_dsa",  # GGUF general.architecture
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "minimax-m2": "minimax_m2",  # GGUF general.architecture
    "glm4moe": "glm4_moe",  # GGUF general.architecture
    "Dots1ForCausalLM": "dots1",
    "ExaoneMoeForCausalLM": "exaone_moe",
    "NemotronHForCausalLM": "nemotron_h",
    "nemotron_h_moe": "nemotron_h",  # GGUF general.architecture (nemotron_h too): Nemotron 3's mixture
    "exaone-moe": "exaone_moe",  # GGUF general.architecture
    "dots1": "dots1",  # GGUF general.architecture too
    "Mamba2ForCausalLM": "mamba2",
    "BambaForCausalLM": "bamba",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoe",  # granitemoe with a shared MLP: its config's width says so
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language models (their vision towers are not loaded): a text token's
    # three multimodal rotary positions are equal, so their sections turn as one plain rotary
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Qwen3VLForConditionalGeneration": "qwen3",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its language model; the vision tower is not loaded
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen35": "qwen3_5",  # GGUF general.architecture
    "qwen35moe": "qwen3_5_moe",
    "qwen3next": "qwen3_next",
    "granitemoeshared": "granitemoe",
    "granitehybrid": "granitemoehybrid",  # GGUF general.architecture: Granite 4.0-H's, and Bamba's (its rotary from
    # rope.dimension_count, a dense FFN: models/spec.py)
    "lfm2": "lfm2",
    "lfm2moe": "lfm2_moe",
    "qwen2moe": "qwen2_moe",  # GGUF general.architecture
    "deepseek2": "deepseek_v2",  # or V3: the header's gating function tells (models/spec.py)
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "llama": "llama",
    "mistral": "mistral",
    "granite": "granite",
    "qwen2": "qwen2",
    "qwen2vl": "qwen2",  # Qwen2-VL's and Qwen2.5-VL's language model (GGUF): M-RoPE, plain for text
    "qwen3": "qwen3",
    "qwen3vl": "qwen3",  # Qwen3-VL's language model (GGUF): interleaved M-RoPE, plain for text
    "qwen3vlmoe": "qwen3_moe",
}


def is_encoder(architecture: str) -> bool:
    """Whether an architecture (HF's class or model_type, a GGUF's or ridge's name) is one of BERT's encoders."""
    return _HF_NAMES.get(architecture, architecture) == "bert"


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
    rope_scaling = temperature = None
    try:
        if spec.rope_scaling:
            rope_scaling = RopeScaling.from_hf(spec.rope_scaling, spec.max_position_embeddings)
            temperature = AttentionTemperature.from_hf(spec.rope_scaling)
    except ValueError as err:
        raise ValueError(f"{spec.source}: {err}") from None
    if spec.is_mla and arch not in _MLA:
        raise ValueError(f"{spec.source}: latent attention (MLA) of architecture {arch!r} is not supported "
                         f"({', '.join(_MLA)})")
    if spec.is_moe and arch not in _MOE:
        raise ValueError(f"{spec.source}: a mixture of experts in architecture {arch!r} is not supported (mixtures "
                         f"of experts: {', '.join(_MOE)})")
    if spec.ssm_layers and arch not in _SSM:
        raise ValueError(f"{spec.source}: state-space layers in architecture {arch!r} are not supported "
                         f"({', '.join(_SSM)})")
    if arch == "deepseek_v2" and spec.router_topk_method not in _V2_TOPK_METHODS:
        raise ValueError(f"{spec.source}: topk_method {spec.router_topk_method!r} is not supported "
                         f"({', '.join(_V2_TOPK_METHODS)})")
    if spec.moe_layer_freq != 1:
        raise ValueError(f"{spec.source}: moe_layer_freq: experts on every {spec.moe_layer_freq}-th layer only is "
                         "not supported (1)")
    if spec.index_topk and arch not in _SPARSE_ATTENTION:
        raise ValueError(f"{spec.source}: index_topk: sparse attention's indexer in architecture {arch!r} is not "
                         f"supported ({', '.join(_SPARSE_ATTENTION)})")
    if spec.is_mla and spec.qkv_bias:
        raise ValueError(f"{spec.source}: attention_bias: biases on latent attention's projections are not supported")
    if spec.mlp_bias and arch not in ("starcoder2", "bert"):
        raise ValueError(f"{spec.source}: mlp_bias: biases on the FFN's projections are not supported")
    if spec.clip_qkv is not None:
        raise ValueError(f"{spec.source}: clip_qkv: clamping q, k and v ({spec.clip_qkv}) is not supported")
    granite_scalars = [name for name, value, plain in (
        ("embedding_multiplier", spec.embedding_multiplier, 1.0), ("logits_scaling", spec.logits_scaling, 1.0),
        ("residual_multiplier", spec.residual_multiplier, 1.0),
        ("attention_multiplier", spec.attention_multiplier, None)) if value != plain]
    if arch in ("cohere", "cohere2"):  # Cohere's logit_scale, Granite's logits_scaling inverted
        granite_scalars = [name for name in granite_scalars if name != "logits_scaling"]
    if granite_scalars and arch not in _GRANITE:
        raise ValueError(f"{spec.source}: {', '.join(granite_scalars)}: Granite's scalars on architecture {arch!r} "
                         "are not supported")
    if spec.qk_l2_norm and rope_scaling is not None and rope_scaling.rotation_magnitude() != 1.0:
        raise ValueError(f"{spec.source}: use_qk_norm: q / k L2 norms after a rotary of magnitude "
                         f"{rope_scaling.rotation_magnitude()} are not supported (1: Llama 4's llama3 scaling)")
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
        "rope_scaling": rope_scaling,
        "attention_temperature": temperature or (
            AttentionTemperature(*spec.nope_temperature, offset=1.0, nope_layers_only=True)
            if spec.nope_temperature else None),
        "chunked_window": spec.chunked_window,
        "qk_l2_norm": spec.qk_l2_norm,
        "max_position_embeddings": (rope_scaling.context_limit(spec.max_position_embeddings) if rope_scaling
                                    else spec.max_position_embeddings),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "qkv_bias": spec.qkv_bias,
        # a window as long as the context is no window (Phi-3-mini-128k's 262,144 of 131,072 positions)
        "sliding_window": spec.sliding_window if spec.sliding_window < spec.max_position_embeddings else 0,
        "global_every": spec.global_every,
        "rope_local_theta": spec.rope_local_theta,
        "nope_layers": spec.nope_layers,
        "hidden_act": spec.hidden_act,
        "gated_mlp": spec.gated_ffn,
        "mlp_bias": spec.mlp_bias,
        "query_pre_attn_scalar": spec.query_pre_attn_scalar,
        "attn_logit_softcap": spec.attn_logit_softcap,
        "final_logit_softcap": spec.final_logit_softcap,
        "partial_rotary_factor": spec.partial_rotary_factor,
        "has_mlp": spec.has_ffn,
        "mlp_free_layers": spec.mlp_free_layers,
        # HF's llama-family attention_bias puts a bias on o_proj too (Qwen2's q / k / v biases come without one)
        "attention_out_bias": (spec.attention_out_bias if spec.attention_out_bias is not None
                               else arch in _OUT_BIAS and spec.qkv_bias),
        "swiglu_limit": spec.swiglu_limit,
        "swiglu_alpha": spec.swiglu_alpha,
        "embedding_multiplier": spec.embedding_multiplier,
        "residual_multiplier": spec.residual_multiplier,
        "attention_multiplier": spec.attention_multiplier,
        "logits_scaling": spec.logits_scaling,
    }
    if arch == "bert":  # its position table's first rows before position_offset are never read
        fields.update(type_vocab_size=spec.type_vocab_size, position_offset=spec.position_offset,
                      max_position_embeddings=spec.max_position_embeddings - spec.position_offset,
                      num_labels=spec.num_labels)
    if spec.vision is not None:
        fields.update(vision=spec.vision, image_token_id=spec.image_token_id, mrope_section=spec.mrope_section,
                      mrope_interleaved=spec.mrope_interleaved)
    if arch == "gemma4":
        fields.update(global_head_dim=spec.global_head_dim, global_kv_heads=spec.global_kv_heads,
                      global_values_from_keys=spec.global_values_from_keys,
                      global_rotary_fraction=spec.global_rotary_fraction, kv_shared_layers=spec.kv_shared_layers,
                      double_wide_shared_mlp=spec.double_wide_shared_mlp,
                      per_layer_input_size=spec.per_layer_input_size, moe_beside_mlp=spec.moe_beside_mlp)
    elif spec.global_head_dim or spec.kv_shared_layers or spec.per_layer_input_size:
        raise ValueError(f"{spec.source}: global heads, KV sharing or per-layer embeddings in architecture {arch!r} "
                         "are not supported (gemma4)")
    if spec.ssm_layers:
        fields.update(ssm_layers=spec.ssm_layers, ssm_state_size=spec.ssm_state_size, ssm_num_heads=spec.ssm_num_heads,
                      ssm_head_dim=spec.ssm_head_dim, ssm_groups=spec.ssm_groups, ssm_conv_kernel=spec.ssm_conv_kernel,
                      ssm_chunk_size=spec.ssm_chunk_size, ssm_conv_bias=spec.ssm_conv_bias,
                      ssm_proj_bias=spec.ssm_proj_bias, ssm_dt_limit=spec.ssm_dt_limit, state_mixer=spec.state_mixer,
                      residual_in_fp32=spec.residual_in_fp32, ssm_heads_tiled=spec.ssm_heads_tiled)
    if spec.attention_output_gate and arch not in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        raise ValueError(f"{spec.source}: an attention output gate in architecture {arch!r} is not supported")
    if spec.is_moe:
        fields.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.moe_intermediate_size,
                      shared_expert_intermediate_size=spec.shared_expert_intermediate_size
                      or spec.shared_experts * spec.moe_intermediate_size,  # DeepSeek: n_shared experts as one FFN
                      shared_expert_gate=spec.shared_expert_gate,
                      dense_layers=spec.dense_layer_indices, router_groups=spec.router_groups,
                      router_topk_groups=spec.router_topk_groups, routed_scaling_factor=spec.routed_scaling_factor)
        if arch == "deepseek_v2" and not _V2_TOPK_METHODS[spec.router_topk_method]:
            fields["router_groups"] = 1  # greedy: n_group, if set, is not used
    if spec.is_mla:  # one KV "head": the latent and the rotary key; scores scaled by the query's own width
        fields.update(num_kv_heads=1, head_dim=spec.kv_lora_rank + spec.qk_rope_head_dim,
                      query_pre_attn_scalar=spec.qk_nope_head_dim + spec.qk_rope_head_dim,
                      kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank or 0,
                      qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                      v_head_dim=spec.v_head_dim, rope_interleave=spec.rope_interleave,
                      partial_rotary_factor=1.0,  # the rotary part is qk_rope_head_dim (Mistral 4's config says
                      # it as a factor too)
                      index_topk=spec.index_topk, index_heads=spec.index_heads, index_head_dim=spec.index_head_dim)
    fields.update(ARCHITECTURES[arch])
    if arch in _OPTIONAL_QK_NORM:
        fields["qk_norm"] = spec.qk_norm_params > 0
    if spec.norm_topk_prob is not None and spec.is_moe and arch not in _ALWAYS_RENORMALISED:  # a router's
        fields["norm_topk_prob"] = bool(spec.norm_topk_prob)
    return ModelConfig(**fields)
