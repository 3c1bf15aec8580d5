"""The arithmetic of serving a model: parameters, bytes, FLOPs and the bounds they set.

Conventions (stated once here, printed by `ridge plan`):
- FLOPs count a multiply-accumulate as 2 FLOPs. Published prefill breakdowns often count MACs (half);
  `Prefill.macs` gives that count beside ours.
- Causal attention scores only the positions at or before each query: T^2 / 2 query-key pairs, not T^2.
- Prefill computes logits for the last position only (what a server does; a perplexity run does all).
- Decode reads every stored weight once per step, except the input embedding table of an untied model (a
  lookup reads B rows); in an MoE layer it reads the experts that the batch's tokens route to.
- Bytes are decimal (GB = 1e9); KV "per token" is the bytes one more token of context adds to a sequence.
- Sparse attention (DeepSeek-V3.2's indexer) holds an indexer key per token beside the latent; a decode step reads
  every token's indexer key and index_topk latent rows, and each query attends to at most index_topk keys.
- A state-space layer (Mamba-2) holds a fixed state per sequence instead of KV, in float32 (as ridge keeps it);
  a decode step reads and writes it whole. Its scan's FLOPs count the recurrent form, with the projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ridge.config import EngineConfig
from ridge.engine.speculative import expected_tokens
from ridge.kv.formats import KV_FORMATS
from ridge.models.spec import AttentionLayers
from ridge.multimodal.vision_config import VisionConfig
from ridge.plan.specs import HardwareSpec, LinkSpec, ModelSpec, Workload, dtype_bytes


@dataclass(frozen=True)
class ParameterCounts:
    embeddings: int  # the input table
    output_head: int  # 0 when tied to the input table
    attention: int  # all attention layers' projections (and biases)
    ssm: int  # all state-space layers' mixers: projections, convolution, per-head parameters, gated norm
    ffn_stored: int  # all layers' FFNs / experts as stored (MoE routers included)
    ffn_active: int  # what one token runs through
    norms: int
    # per-layer embeddings (Gemma 4's E models): the second table (a lookup, as the input table) and the projections
    # that make and gate each layer's input
    per_layer_table: int = 0
    per_layer_linear: int = 0
    # a vision-language model's vision tower (Qwen2-VL's): held in memory, run on images at prefill, never by a
    # decoded token (not in `active`)
    vision: int = 0

    @property
    def stored(self) -> int:
        return (self.embeddings + self.output_head + self.attention + self.ssm + self.ffn_stored + self.norms
                + self.per_layer_table + self.per_layer_linear + self.vision)

    @property
    def active(self) -> int:
        return (self.embeddings + self.output_head + self.attention + self.ssm + self.ffn_active + self.norms
                + self.per_layer_table + self.per_layer_linear)

    @property
    def per_token_linear(self) -> int:
        """The weights one token multiplies by in the decoder layers."""
        return self.attention + self.ssm + self.ffn_active + self.per_layer_linear

    @property
    def head(self) -> int:
        """The vocabulary projection's parameters (the input table itself when tied)."""
        return self.output_head or self.embeddings


def attention_params_per_layer(m: ModelSpec) -> int:
    h = m.hidden_size
    if m.is_mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * qk if m.q_lora_rank
             else h * m.num_heads * qk)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # down-projection (+ its norm)
        kv += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)  # up-projection to K, V
        # sparse attention's indexer: its query from the query's bottleneck, its key (+ LayerNorm), head weights
        indexer = (m.q_lora_rank * m.index_heads * m.index_head_dim + h * m.index_head_dim + 2 * m.index_head_dim
                   + h * m.index_heads) if m.index_topk else 0
        return q + kv + m.num_heads * m.v_head_dim * h + indexer
    q_width, kv_width = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projected = (2 if m.attention_output_gate else 1) * q_width + 2 * kv_width  # q (and its gate), k, v
    return h * projected + q_width * h + (projected if m.qkv_bias else 0)


def attention_params(m: ModelSpec) -> int:
    """Every attention layer's projections: each kind's own heads (Gemma 4's global layers' wider ones, their values
    the keys' projection; a KV-shared layer's q and o alone)."""
    if m.is_mla:
        return m.num_attention_layers * attention_params_per_layer(m)
    total = 0
    for kind in m.attention_layer_kinds():
        q_width, kv_width = m.num_heads * kind.head_dim, kind.kv_heads * kind.head_dim
        projected = (2 if m.attention_output_gate else 1) * q_width + kind.projected_kv * kv_width
        total += kind.count * (m.hidden_size * (projected + q_width) + (projected if m.qkv_bias else 0))
    return total


def ssm_params_per_layer(m: ModelSpec) -> int:
    """A Mamba-2 mixer: the input projection (to z, x, B, C and dt), the depthwise convolution, dt_bias, A and D
    per head, the gated norm, the output projection (biases left out, as rounding). LFM2's short convolution: the
    input projection (to B, C and x), the depthwise convolution, the output projection, with conv_bias a bias on
    each. A gated DeltaNet: the input projection (to q, k, v, z, beta and the decay), the depthwise convolution,
    dt_bias and A per head, the norm (one head's width), the output projection."""
    if m.state_mixer == "gated_delta":
        channels = m.ssm_conv_channels
        return m.hidden_size * (channels + m.ssm_inner_size + 2 * m.ssm_num_heads) + channels * m.ssm_conv_kernel \
            + 2 * m.ssm_num_heads + m.ssm_head_dim + m.ssm_inner_size * m.hidden_size
    if m.state_mixer == "short_conv":
        h = m.hidden_size
        return 3 * h * h + h * m.ssm_conv_kernel + h * h + (5 * h if m.ssm_conv_bias else 0)
    channels = m.ssm_conv_channels
    in_proj = m.hidden_size * (m.ssm_inner_size + channels + m.ssm_num_heads)
    return in_proj + channels * (m.ssm_conv_kernel + 1) + 3 * m.ssm_num_heads + m.ssm_inner_size \
        + m.ssm_inner_size * m.hidden_size


def ffn_params(m: ModelSpec, width: int) -> int:
    return (3 if m.gated_ffn else 2) * m.hidden_size * width


def count_parameters(m: ModelSpec) -> ParameterCounts:
    moe_layers = m.num_moe_layers
    dense_layers = m.num_ffn_layers - moe_layers
    expert = ffn_params(m, m.moe_intermediate_size)
    router = m.hidden_size * m.num_experts
    shared = m.shared_experts * ffn_params(m, m.shared_expert_intermediate_size or m.moe_intermediate_size)
    if m.shared_expert_gate:  # one more row
        shared += m.hidden_size
    # Gemma 4's KV-shared layers' MLPs, twice as wide where double_wide_shared_mlp: the second half; its 26B-A4B's
    # dense MLP beside each layer's experts
    widened = m.kv_shared_layers * ffn_params(m, m.intermediate_size) if m.double_wide_shared_mlp else 0
    widened += moe_layers * ffn_params(m, m.intermediate_size) if m.moe_beside_mlp else 0
    ffn_stored = dense_layers * ffn_params(m, m.intermediate_size) + widened + moe_layers * (
        m.num_experts * expert + shared + router)
    ffn_active = dense_layers * ffn_params(m, m.intermediate_size) + widened + moe_layers * (
        m.experts_per_token * expert + shared + router)
    embeddings = m.vocab_size * m.hidden_size
    per_layer = m.num_layers * m.per_layer_input_size  # a token's per-layer inputs, all layers'
    return ParameterCounts(
        embeddings=embeddings, output_head=0 if m.tie_word_embeddings else embeddings,
        attention=attention_params(m),
        ssm=len(m.ssm_layers) * ssm_params_per_layer(m) if m.ssm_layers else 0,
        ffn_stored=ffn_stored, ffn_active=ffn_active,
        norms=(m.num_layers + m.num_ffn_layers + 1) * m.hidden_size + m.num_attention_layers * m.qk_norm_params
        + (m.num_layers * m.hidden_size + m.per_layer_input_size if per_layer else 0),
        # the model's projection of the embeddings to them, and each layer's gate and projection back
        per_layer_table=m.vocab_size * per_layer, per_layer_linear=3 * m.hidden_size * per_layer,
        vision=vision_params(m.vision) if m.vision is not None else 0)


def vision_params(v: VisionConfig) -> int:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower's parameters (models/vision.py): the patch embedding (and
    Qwen3-VL's position table), the blocks (two norms, q/k/v and the output projection, the MLP, all biased) and the
    mergers (Qwen3-VL's DeepStack ones norm the joined patches); Mistral 3's Pixtral encoder and projector; Gemma 3's
    SigLIP encoder and projector."""
    w, inner = v.width, v.intermediate_size
    if v.family == "siglip":  # biases everywhere, a position table, a final norm; the projector's norm and matrix
        layer = 2 * 2 * w + 4 * (w * w + w) + 2 * w * inner + inner + w
        return v.patch_values * w + w + v.position_embeddings * w + v.depth * layer + 2 * w + w + w * v.output_size
    if v.family == "pixtral":  # no biases in the encoder; the projector's norm, join and two projections
        layer = 2 * w + 4 * w * w + 3 * w * inner
        bias = 2 * v.output_size if v.projector_bias else 0
        projector = w + w * v.merge_size**2 * w + w * v.output_size + v.output_size**2 + bias
        return v.patch_values * w + w + v.depth * layer + projector
    norm = w if v.rms_norm else 2 * w
    mlp = (3 * w * inner + 2 * inner + w) if v.gated_mlp else (2 * w * inner + inner + w)
    block = 2 * norm + 3 * w * w + 3 * w + w * w + w + mlp
    joined = w * v.merge_size**2
    merger_linears = joined * joined + joined + joined * v.output_size + v.output_size
    mergers = norm + merger_linears + len(v.deepstack_blocks) * (norm * v.merge_size**2 + merger_linears)
    embedding = v.patch_values * w + (w if v.patch_bias else 0) + v.position_embeddings * w
    return embedding + v.depth * block + mergers


def weight_bytes(m: ModelSpec, dtype: str) -> float:
    """Every stored parameter at `dtype` (norms at 2 bytes: no format quantizes them)."""
    p = count_parameters(m)
    # a vision tower stays in the model's 16- or 32-bit dtype, whatever the language model's weights are stored in
    return (p.stored - p.norms - p.vision) * dtype_bytes(dtype) + p.norms * 2 + p.vision * max(2, dtype_bytes(dtype))


# ---- KV cache


def kv_bytes_per_token(m: ModelSpec, kv_dtype: str) -> float:
    """What one token of context adds to the cache across all layers (a local layer's too, until its
    window fills): K and V per KV head, or MLA's latent plus its shared rotary key. fp8 / int8 / int4 are
    ridge's quantized caches (kv/formats.py): codes and scales, a block's per-channel key scales shared by its
    tokens (blocks of the engine's default size)."""
    if not m.is_mla:
        return sum(kind.count * _kind_kv_bytes_per_token(kind, kv_dtype)
                   for kind in m.attention_layer_kinds() if kind.holds_kv)
    quantized = KV_FORMATS.get(kv_dtype)
    row_dim = m.kv_lora_rank + m.qk_rope_head_dim
    row_bytes = quantized.row_bytes(row_dim) if quantized is not None else row_dim * dtype_bytes(kv_dtype)
    return (row_bytes + _index_key_bytes(m, kv_dtype)) * m.num_attention_layers


def _kind_kv_bytes_per_token(kind: AttentionLayers, kv_dtype: str) -> float:
    """One token's K and V in one layer of a kind (its cache's, for a KV-shared one)."""
    quantized = KV_FORMATS.get(kv_dtype)
    if quantized is not None:
        block_size = EngineConfig.block_size
        return kind.kv_heads * quantized.block_bytes(kind.head_dim, block_size) / block_size
    return 2 * kind.kv_heads * kind.head_dim * dtype_bytes(kv_dtype)


def _index_key_bytes(m: ModelSpec, kv_dtype: str) -> float:
    """Sparse attention's indexer key, one a token a layer, kept in the cache's dtype (0 without an indexer)."""
    return m.index_head_dim * dtype_bytes(kv_dtype) if m.index_topk else 0.0


def kv_bytes(m: ModelSpec, kv_dtype: str, tokens: int) -> float:
    """The cache of one sequence of `tokens`: local layers keep their last sliding_window tokens only (a chunked
    window at most a chunk: its bound)."""
    if not m.num_attention_layers:
        return 0.0
    if not m.is_mla:
        return sum(kind.count * _kind_kv_bytes_per_token(kind, kv_dtype) * (
            min(tokens, m.sliding_window) if kind.local else tokens)
            for kind in m.attention_layer_kinds() if kind.holds_kv)
    per_layer_token = kv_bytes_per_token(m, kv_dtype) / m.num_attention_layers
    local = m.local_layers
    return per_layer_token * ((m.num_attention_layers - local) * tokens
                              + local * min(tokens, m.sliding_window or tokens))


def kv_read_bytes(m: ModelSpec, kv_dtype: str, context: int) -> float:
    """What one decode step reads of a sequence's cache at `context` tokens: the keys its query sees in each layer
    (a chunked layer's: its own chunk's, where kv_bytes bounds what it holds by a whole chunk); under sparse
    attention every token's indexer key but the latent rows of index_topk tokens only."""
    if not m.num_attention_layers:
        return 0.0
    if not m.is_mla:  # a KV-shared layer reads its source's cache: as much as a layer of its kind
        return sum(kind.count * _kind_kv_bytes_per_token(kind, kv_dtype) * (
            _local_keys(m, context) if kind.local else context) for kind in m.attention_layer_kinds())
    if not m.index_topk:
        per_layer_token = kv_bytes_per_token(m, kv_dtype) / m.num_attention_layers
        local = m.local_layers
        return per_layer_token * ((m.num_attention_layers - local) * context + local * _local_keys(m, context))
    index_key = _index_key_bytes(m, kv_dtype)
    row = kv_bytes_per_token(m, kv_dtype) / m.num_attention_layers - index_key
    return m.num_attention_layers * (context * index_key + min(context, m.index_topk) * row)


def state_bytes(m: ModelSpec) -> float:
    """The recurrent state of one sequence, whatever its length: per state-space layer, the convolution's last
    ssm_conv_kernel - 1 inputs and the SSM state of heads x head_dim x state_size, in float32."""
    per_layer = m.ssm_conv_channels * (m.ssm_conv_kernel - 1) + m.ssm_inner_size * m.ssm_state_size
    return 4.0 * per_layer * len(m.ssm_layers)


def tail_bytes(m: ModelSpec, kv_dtype: str) -> float:
    """A format with tails (int2) keeps the block a sequence is filling unquantized: a block's K and V per KV head
    and attention layer, in the activations' 16 bits (blocks of the engine's default size)."""
    quantized = KV_FORMATS.get(kv_dtype)
    if quantized is None or not quantized.tail or m.is_mla:
        return 0.0
    return sum(2.0 * kind.count * kind.kv_heads * EngineConfig.block_size * kind.head_dim * 2
               for kind in m.attention_layer_kinds() if kind.holds_kv)


def sequence_cache_bytes(m: ModelSpec, kv_dtype: str, tokens: int) -> float:
    """What one sequence of `tokens` holds: its KV (with its tail) and its recurrent state."""
    return kv_bytes(m, kv_dtype, tokens) + tail_bytes(m, kv_dtype) + state_bytes(m)


def ssm_flops_per_token(m: ModelSpec) -> float:
    """The scan's own work per token over all state-space layers (the recurrent form: decay, update and read
    the state; the convolution), beside the projections' 2 FLOPs a weight."""
    return len(m.ssm_layers) * (6.0 * m.ssm_inner_size * m.ssm_state_size
                                + 2.0 * m.ssm_conv_channels * m.ssm_conv_kernel)


# ---- FLOPs


def _attended_pairs(tokens: int, window: int, chunked: bool = False) -> float:
    """Query-key pairs a causal layer scores over a prompt: sum over positions of the keys each sees, min(position +
    1, window); a chunked window's query sees the keys of its own chunk (each whole chunk C(C + 1) / 2 pairs)."""
    if not window or tokens <= window:
        return tokens * (tokens + 1) / 2
    if chunked:
        rest = tokens % window
        return tokens // window * window * (window + 1) / 2 + rest * (rest + 1) / 2
    return window * (window + 1) / 2 + (tokens - window) * window


def _local_keys(m: ModelSpec, context: int) -> int:
    """The keys a local layer's query sees with `context` tokens of context (itself included)."""
    window = m.sliding_window or context
    return (context - 1) % window + 1 if m.chunked_window else min(context, window)


def _layer_keys(m: ModelSpec, context: int, local: bool) -> int:
    """The keys a query at `context` tokens of context attends to in one layer (windowed, or not)."""
    if m.index_topk:  # sparse attention: the indexer's choice
        return min(context, m.index_topk)
    return _local_keys(m, context) if local else context


def _indexer_flops(m: ModelSpec, keys: float) -> float:
    """Sparse attention's indexer scoring `keys` query-key pairs in every attention layer (0 without one)."""
    return 2.0 * m.index_heads * m.index_head_dim * keys * m.num_attention_layers if m.index_topk else 0.0


def _attention_flops(m: ModelSpec, keys: Callable[[bool], float]) -> float:
    """QK^T and PV over every attention layer, each layer's query heads over keys(local) keys (a count of pairs
    over a prompt, or of one query's keys), in each layer's own head width."""
    if m.is_mla:  # (query-key dot length, value length) per head, as the absorbed math runs them
        local = m.local_layers
        return 2.0 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * (
            (m.num_attention_layers - local) * keys(False) + local * keys(True))
    return sum(2.0 * m.num_heads * 2 * kind.head_dim * kind.count * keys(kind.local)
               for kind in m.attention_layer_kinds())


@dataclass(frozen=True)
class Prefill:
    tokens: int
    linear_flops: float  # projections and FFNs for every token, the vocabulary projection for the last
    attention_flops: float  # QK^T and PV over the causal pairs

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def macs(self) -> float:
        """The same work in multiply-accumulates, the unit many published breakdowns use."""
        return self.flops / 2


def prefill(m: ModelSpec, tokens: int, bidirectional: bool = False) -> Prefill:
    """A prompt's pass; bidirectional: an encoder's, every token attending to all `tokens` (T^2 pairs) and no
    output head."""
    p = count_parameters(m)
    per_token = 2.0 * p.per_token_linear + ssm_flops_per_token(m)  # biases and routers: rounding, counted as weights

    def pairs(local: bool) -> float:
        if bidirectional:
            return float(tokens) * tokens
        if m.index_topk:  # each query attends to at most index_topk keys: a window's count of pairs
            return _attended_pairs(tokens, m.index_topk)
        return _attended_pairs(tokens, m.sliding_window, m.chunked_window) if local else _attended_pairs(tokens, 0)

    return Prefill(tokens, linear_flops=per_token * tokens + (0.0 if bidirectional else 2.0 * p.head),
                   attention_flops=_attention_flops(m, pairs) + _indexer_flops(m, _attended_pairs(tokens, 0)))


def attention_crossover(m: ModelSpec) -> int | None:
    """The prompt length from which the attention term outgrows the linear one (None: it never does, as
    with sliding windows everywhere, or not below 100M tokens)."""
    def attention_larger(t: int) -> bool:
        f = prefill(m, t)
        return f.attention_flops > f.linear_flops - 2.0 * count_parameters(m).head

    low, high = 1, 100_000_000
    if not attention_larger(high):
        return None
    while low < high:  # the first t where attention is larger
        mid = (low + high) // 2
        low, high = (mid + 1, high) if not attention_larger(mid) else (low, mid)
    return low


# ---- decode


def experts_touched(m: ModelSpec, batch: int) -> float:
    """Expected distinct routed experts a layer reads for `batch` tokens, routing taken as uniform."""
    if not m.is_moe:
        return 0.0
    return m.num_experts * (1 - (1 - m.experts_per_token / m.num_experts) ** batch)


def decode_weight_bytes(m: ModelSpec, dtype: str, batch: int = 1) -> float:
    """Weight bytes one decode step of `batch` sequences reads."""
    p = count_parameters(m)
    read = p.stored - p.norms - (p.embeddings if p.output_head else 0) - p.per_layer_table  # lookups: B rows each
    if m.is_moe:
        moe_layers = m.num_moe_layers
        unread = m.num_experts - experts_touched(m, batch)
        read -= moe_layers * unread * ffn_params(m, m.moe_intermediate_size)
    return read * dtype_bytes(dtype) + p.norms * 2


def decode_step_flops(m: ModelSpec, batch: int, context: int) -> float:
    """FLOPs of one decode step: each of `batch` sequences adds a token at `context` tokens of context."""
    p = count_parameters(m)
    per_sequence = (2.0 * (p.per_token_linear + p.head) + ssm_flops_per_token(m)
                    + _attention_flops(m, lambda local: _layer_keys(m, context, local)) + _indexer_flops(m, context))
    return batch * per_sequence


def generation_flops(m: ModelSpec, prompt_tokens: int, new_tokens: int) -> float:
    """FLOPs of one request: its prompt's prefill (which yields the first new token), then a decode step per
    further token."""
    p = count_parameters(m)  # once, not once a step: a benchmark sums thousands of steps
    contexts = range(prompt_tokens + 1, prompt_tokens + new_tokens)
    attended = {local: sum(_layer_keys(m, ctx, local) for ctx in contexts) for local in (False, True)}
    steps = new_tokens - 1
    return (prefill(m, prompt_tokens).flops + (2.0 * (p.per_token_linear + p.head) + ssm_flops_per_token(m)) * steps
            + _attention_flops(m, attended.__getitem__) + _indexer_flops(m, sum(contexts)))


@dataclass(frozen=True)
class Bound:
    """A phase's lower time bound: the larger of its bytes over bandwidth and its FLOPs over peak."""
    bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def wall(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "bandwidth"


def bound(bytes_: float, flops: float, hw: HardwareSpec, compute_dtype: str, gpus: int = 1) -> Bound:
    """Ideal tensor parallelism over `gpus`: bandwidth and FLOP/s add up (communication not counted)."""
    return Bound(bytes_, flops, bytes_ / (hw.bandwidth_gb_s * 1e9 * gpus), flops / (hw.flops(compute_dtype) * gpus))


def step_bound(model: ModelSpec, hw: HardwareSpec, workload: Workload, batch: int, tokens: int = 1) -> Bound:
    """A target pass of `batch` sequences, `tokens` new tokens each (1: a decode step; k + 1: speculative
    verification), at the workload's context: weights read once, each sequence's KV once, its recurrent state
    read and written."""
    w = workload
    weights = decode_weight_bytes(model, w.dtype, batch * tokens)
    kv = batch * (kv_read_bytes(model, w.kv_dtype, w.context) + tail_bytes(model, w.kv_dtype)
                  + 2 * state_bytes(model))
    return bound(weights + kv, decode_step_flops(model, batch * tokens, w.context), hw, compute_dtype(w.dtype),
                 w.gpus)


# ---- tensor parallelism's communication


def ring_allreduce_seconds(nbytes: float, gpus: int, link: LinkSpec) -> float:
    """A ring all-reduce of nbytes over `gpus` devices (NCCL's algorithm for large messages): 2(n-1) steps, each a
    link latency, moving 2(n-1)/n of the bytes over each device's link."""
    if gpus == 1:
        return 0.0
    return 2 * (gpus - 1) * link.latency_us * 1e-6 + 2 * (gpus - 1) / gpus * nbytes / (link.bandwidth_gb_s * 1e9)


def gather_seconds(nbytes: float, gpus: int, link: LinkSpec) -> float:
    """The logits gathered on one device: the others' (n-1)/n of nbytes over its link, a latency per peer."""
    if gpus == 1:
        return 0.0
    return (gpus - 1) * link.latency_us * 1e-6 + (gpus - 1) / gpus * nbytes / (link.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class Communication:
    """One pass of `tokens` tokens under tensor parallelism: an all-reduce after each layer's mixer and after its
    FFN (the embedding's too), of tokens x hidden activations each, and the float32 logits' gather."""

    allreduces: int
    bytes_per_allreduce: float
    logits_bytes: float
    seconds: float


def tp_communication(m: ModelSpec, tokens: int, logit_rows: int, gpus: int, link: LinkSpec,
                     activation_bytes: float) -> Communication:
    allreduces = m.num_layers + m.num_ffn_layers + 1
    nbytes = tokens * m.hidden_size * activation_bytes
    logits = logit_rows * m.vocab_size * 4.0
    seconds = allreduces * ring_allreduce_seconds(nbytes, gpus, link) + gather_seconds(logits, gpus, link)
    return Communication(allreduces, nbytes, logits, seconds)


def compute_dtype(weight_dtype: str) -> str:
    """The dtype the matmuls run in: fp8 / int8 weights on the tensor cores of that dtype where the
    hardware has them (HardwareSpec.flops falls back), int4 dequantized to bf16, else the weights' own."""
    return {"int4": "bf16", "fp4": "fp4", "fp32": "fp32"}.get(weight_dtype, weight_dtype)


# ---- speculative decoding and cost


def expected_tokens_per_pass(accept: float, k: int) -> float:
    """engine/speculative.py's expected_tokens (the engine's adaptive k uses the same), for a plan's inputs:
    refused by name outside [0, 1) and below one drafted token."""
    if not 0 <= accept < 1:
        raise ValueError(f"accept: {accept} is outside [0, 1)")
    if k < 1:
        raise ValueError(f"k: {k} drafted tokens; at least 1")
    return expected_tokens(accept, k)


def speculative_speedup(accept: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit time against plain decoding. draft_cost: a drafter step's time as a fraction of a
    target step; verify_cost: a target pass over k + 1 tokens as a multiple of a one-token step (1 where
    the step is bandwidth-bound, up to k + 1 where it is compute-bound)."""
    if draft_cost < 0:
        raise ValueError(f"draft cost: {draft_cost} is negative")
    return expected_tokens_per_pass(accept, k) / (k * draft_cost + verify_cost)


def cost_per_million_tokens(price_per_hour: float, tokens_per_second: float) -> float:
    if tokens_per_second <= 0:
        raise ValueError(f"throughput: {tokens_per_second} tok/s; must be positive")
    return price_per_hour / (tokens_per_second * 3600) * 1e6
