"""Shared building blocks: RMSNorm, rotary embedding, attention projections, gated MLP.

Weights are fused where the math allows one matmul instead of several (q/k/v, gate/up): on a CPU
each op costs microseconds of overhead regardless of size, and a small model runs hundreds per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ridge.attention.backend import AttentionBackend, StepMetadata
from ridge.config import ModelConfig
from ridge.rope_scaling import AttentionTemperature, RopeScaling


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (vLLM's (x, residual) convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: ModuleType | None = None  # fused CPU kernels, set by DecoderModel.use_kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given a residual: residual += x (in place), return (norm(residual), residual)."""
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if residual.dtype != x.dtype:  # a float32 residual stream (residual_in_fp32): normed in x's dtype
            residual += x
            return F.rms_norm(residual.to(x.dtype), self.weight.shape, self.weight, self.eps), residual
        if self.ops is not None and x.is_contiguous() and residual.is_contiguous():
            return self.ops.add_rms_norm_(residual, x, self.weight, self.eps), residual
        residual += x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class LayerNorm(RMSNorm):
    """LayerNorm, mean-centred, computed in float32: a weight and no bias (Cohere's), or both (StarCoder2's);
    RMSNorm's (x, residual) convention."""

    def __init__(self, dim: int, eps: float, bias: bool = False) -> None:
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual += x
        return self._norm(residual.to(x.dtype)), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)


class HeadLayerNorm(nn.Module):
    """Command R+'s q / k norm: a LayerNorm (no bias, in float32) over each head, each head its own weight."""

    def __init__(self, heads: int, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim]."""
        normed = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class L2Norm(nn.Module):
    """Llama 4's q / k norm: each head divided by its RMS, without a weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), None, self.eps)


def make_norm(cfg: ModelConfig) -> RMSNorm:
    """A hidden-wide norm of the model's kind (RMSNorm, or a LayerNorm)."""
    if cfg.norm_kind == "layer":
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ResidualAdd(nn.Module):
    """A layer's input where it has no pre-norm (OLMo-2 norms its mixer's and MLP's outputs instead): RMSNorm's
    (x, residual) convention without the norm."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x; or, given a residual: residual += x (in place), return (a copy of residual in x's dtype, residual)."""
        if residual is None:
            return x
        residual += x
        # a copy: the stream is added to in place while the sublayer's input may still be held (a captured state)
        return residual.to(x.dtype, copy=True), residual


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) rotary as a complex multiply: (x1 + i*x2) * e^(i*pos*freq) per frequency."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None,
                 temperature: AttentionTemperature | None = None, turning_fraction: float = 1.0,
                 sections: tuple[int, ...] | None = None, interleaved_sections: bool = False) -> None:
        """turning_fraction: only the first share of the frequencies turn, the rest are 0 (Gemma 4's proportional
        RoPE: a rotary as wide as the head whose slow pairs stay still). sections: M-RoPE's (Qwen2-VL's): the
        frequencies in three runs, each turned by its own one of a token's three positions (step());
        interleaved_sections (Qwen3-VL's): the row's and the column's frequencies taken in turn with the time's
        (time, row, column, time, ...) until each has its count, the rest the time's."""
        super().__init__()
        # each frequency's position: 0 (time), 1 (row) or 2 (column)
        self.section_of = None if sections is None else _section_of(sections, interleaved_sections)
        self.temperature = temperature  # the queries of the layers that turn with this rotary: sharpened by position
        if scaling is None:
            inv_freq, magnitude = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
        else:  # a scaled rotary's own frequencies, and YaRN's rotation magnitude (q.k scaled by its square)
            inv_freq, magnitude = scaling.inverse_frequencies(head_dim, theta), scaling.rotation_magnitude()
        inv_freq[int(turning_fraction * head_dim) // 2:] = 0.0
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("freqs", torch.polar(torch.full_like(angles, magnitude), angles), persistent=False)
        self.ops: ModuleType | None = None

    def mean_rotation(self, x: torch.Tensor, positions: int) -> torch.Tensor:
        """x [..., head_dim] rotated as a key at each of positions 0..positions-1 would be, averaged (float32)."""
        half = self.freqs.shape[-1]
        out = x.float().clone()
        z = torch.complex(out[..., :half], out[..., half:2 * half]) * self.freqs[:positions].mean(0)
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
        return out

    def step(self, positions: torch.Tensor) -> RopeStep:
        """The step's rotary for its tokens' positions: [T], or M-RoPE's [3, T] (each token's time, row and column)."""
        if positions.dim() == 2:
            # each token's own rotations, frequency by frequency from its position of that frequency's section: a
            # table of the step's rows, which the tokens index in order
            if self.section_of is None:
                raise ValueError("a rotary without M-RoPE sections was given three positions a token")
            rows = self.freqs[positions]  # [3, T, head_dim / 2]
            section_of = self.section_of.to(rows.device).expand(1, positions.shape[1], -1)
            table = rows.gather(0, section_of).squeeze(0)
            return RopeStep(torch.arange(positions.shape[1], device=positions.device), table,
                            torch.view_as_real(table), self.ops)
        # the kernel's view of the table (float pairs): made once a step, not once per layer
        scales = self.temperature.query_scales(positions) if self.temperature is not None else None
        return RopeStep(positions, self.freqs, torch.view_as_real(self.freqs), self.ops, scales)


def _section_of(sections: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Each frequency's M-RoPE section (0, 1, 2) under `sections` (the count of each), runs or interleaved."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
    of = torch.zeros(sum(sections), dtype=torch.long)
    for section in range(1, len(sections)):
        of[section:len(sections) * sections[section]:len(sections)] = section
    return of


@dataclass
class RopeStep:
    """One step's rotary: the positions of its tokens, shared by every layer."""

    positions: torch.Tensor
    freqs: torch.Tensor  # complex64 [max_positions, head_dim / 2]
    table: torch.Tensor  # freqs as float32 pairs [max_positions, head_dim / 2, 2], for the kernel
    ops: ModuleType | None
    query_scales: torch.Tensor | None = None  # float32 [T]: each token's query multiplier (AttentionTemperature)
    _rotations: torch.Tensor | None = None

    def temper_(self, q: torch.Tensor) -> None:
        """Multiply each token's queries q [T, ...] in place by its position's temperature, where there is one."""
        if self.query_scales is not None:
            q.mul_(self.query_scales.view(-1, *(1,) * (q.dim() - 1)).to(q.dtype))

    def apply_(self, x: torch.Tensor, heads: int) -> None:
        """Rotate heads [0, heads) of x: [T, all_heads, head_dim] in place; with a partial rotary (a table
        narrower than the head), only each head's first dims, the rest pass through; with none (NoPE), nothing."""
        rotary_dim = 2 * self.freqs.shape[-1]
        if rotary_dim == 0:
            return
        if rotary_dim < x.shape[-1]:
            x = x[..., :rotary_dim]  # a view: rotated in place below
        if self.ops is not None and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) >= x.shape[2]):
            self.ops.rotary_(x, self.positions, self.table, heads)
            return
        if self._rotations is None:
            self._rotations = self.freqs[self.positions].unsqueeze(1)
        apply_rotary_(x[:, :heads], self._rotations)


def apply_rotary_(x: torch.Tensor, rotations: torch.Tensor) -> None:
    """Rotate x: [T, heads, head_dim] in place; x[..., :d/2] and x[..., d/2:] are the real/imaginary parts.

    Four ops for q and k together, where the textbook rotate_half form costs ten per tensor; on a CPU
    at batch 1 the op count, not the arithmetic, sets the time.
    """
    pairs = x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2)  # [T, heads, d/2, 2], a view
    z = torch.view_as_complex(torch.empty(pairs.shape, dtype=torch.float32, device=x.device).copy_(pairs))
    pairs.copy_(torch.view_as_real(z * rotations))


@dataclass
class ShardedFullNorm:
    """q and k normed over all their heads at once (OLMoE) when a tensor-parallel rank holds some of the heads
    (cluster/shards.py): each rank's squares of q, and of k where it is the first rank to hold its KV heads (a
    replicated head counts once), summed over the ranks by one all-reduce."""

    q_width: int  # q's width over all heads
    k_width: int
    counts_k: bool
    all_reduce: Callable[[torch.Tensor], None] | None = None  # set with the layers' (cluster/collectives.py)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        head_dim = cfg.layer_head_dim(layer_index)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.layer_kv_heads(layer_index), head_dim
        # KV sharing (Gemma 4): the layer whose cache this one attends to, itself unless it projects no K / V
        self.kv_layer = cfg.kv_source(layer_index)
        self.kv_shared = self.kv_layer != layer_index
        self.values_from_keys = cfg.global_values_from_keys and not cfg.is_local(layer_index)
        q_size, kv_size = cfg.num_heads * head_dim, self.num_kv_heads * head_dim
        kv_rows = 0 if self.kv_shared else kv_size if self.values_from_keys else 2 * kv_size
        # with an output gate (Qwen3.5), its rows follow v's: one projection gives all four
        self.gated = cfg.attention_output_gate
        self.qkv = nn.Linear(cfg.hidden_size, (2 if self.gated else 1) * q_size + kv_rows, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        # gpt-oss: each query head's sink logit, in the denominator of its softmax (attention/backend.py)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        # qk_norm: over each head (Qwen3, Gemma 3); qk_norm_full: over all of q's heads at once, and k's (OLMoE)
        q_width, k_width = (q_size, kv_size) if cfg.qk_norm_full else (head_dim, head_dim)
        normed = cfg.qk_norm or cfg.qk_norm_full
        self.q_norm: nn.Module | None = RMSNorm(q_width, cfg.rms_norm_eps) if normed else None
        self.k_norm: nn.Module | None = RMSNorm(k_width, cfg.rms_norm_eps) if normed and not self.kv_shared else None
        if cfg.qk_l2_norm and layer_index not in cfg.nope_layers:  # Llama 4's, on its rotary layers
            self.q_norm = self.k_norm = L2Norm(head_dim, cfg.rms_norm_eps)
        if cfg.qk_norm and cfg.norm_kind == "layer":  # Command R+'s: LayerNorms, a weight for each head
            self.q_norm = HeadLayerNorm(cfg.num_heads, head_dim, cfg.rms_norm_eps)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, head_dim, cfg.rms_norm_eps)
        self.v_norm = L2Norm(head_dim, cfg.rms_norm_eps) if cfg.value_norm and not self.kv_shared else None
        self.norm_full = cfg.qk_norm_full
        self.sharded_norm: ShardedFullNorm | None = None

    @property
    def gemma4(self) -> bool:
        """Whether the layer runs Gemma 4's form of attention (_forward_gemma4)."""
        return self.kv_shared or self.values_from_keys or self.v_norm is not None

    def key_center(self, rotary: RotaryEmbedding, positions: int) -> torch.Tensor | None:
        """The key bias as rotary turns it, averaged over positions 0..positions-1: [kv_heads, head_dim] float32,
        the constant a quantized cache takes off every key before rounding it (attention/quantized_kv.py); None
        where keys have no additive bias after the projection (none, or a k norm after it)."""
        bias = self.qkv.bias
        if bias is None or self.k_norm is not None:
            return None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return rotary.mean_rotation(bias.detach()[q_size:q_size + kv_size].view(self.num_kv_heads, -1), positions)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        backend: AttentionBackend,
        meta: StepMetadata,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """shared_kv: a model with KV sharing's step k, v by layer, which a layer whose cache others share puts its
        own in, and a layer that shares one reads (the cache holds them too, but a prompt's first chunk attends to
        them as they are)."""
        if self.gemma4:
            return self._forward_gemma4(x, rope, backend, meta, shared_kv)
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, -1, self.head_dim)
        # split_with_sizes: Tensor.split's Python wrapper cost as much as the split, 30 times a step
        q, k, v, *gate = qkv.split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads] + ([self.num_heads] if self.gated else []), dim=1)
        if self.norm_full:
            if self.sharded_norm is not None:
                q, k = self._sharded_full_norm(q, k)
            else:
                q = self.q_norm(q.reshape(tokens, -1)).view(tokens, self.num_heads, self.head_dim)
                k = self.k_norm(k.reshape(tokens, -1)).view(tokens, self.num_kv_heads, self.head_dim)
            rope.apply_(q, self.num_heads)
            rope.apply_(k, self.num_kv_heads)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            rope.apply_(q, self.num_heads)
            rope.apply_(k, self.num_kv_heads)
        else:  # q and k sit side by side in qkv: rotate both in one go
            rope.apply_(qkv, self.num_heads + self.num_kv_heads)
        rope.temper_(q)
        out = (backend.forward(self.layer_index, q, k, v, meta) if self.sinks is None
               else backend.forward(self.layer_index, q, k, v, meta, self.sinks))  # a backend that handles_sinks
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        if self.gated:
            out = out * torch.sigmoid(gate[0].reshape(tokens, -1))
        return self.o_proj(out)

    def _forward_gemma4(self, x: torch.Tensor, rope: RopeStep, backend: AttentionBackend, meta: StepMetadata,
                        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """Gemma 4's attention: q, k and v each normed over every head (v without a weight), a global layer's
        values its raw keys, and the KV-shared layers' k, v their source layer's."""
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, -1, self.head_dim)
        q = self.q_norm(qkv[:, :self.num_heads])
        if self.kv_shared:
            k, v = shared_kv[self.kv_layer]
        else:
            k = qkv[:, self.num_heads:self.num_heads + self.num_kv_heads]
            v = k if self.values_from_keys else qkv[:, self.num_heads + self.num_kv_heads:]
            k, v = self.k_norm(k), self.v_norm(v)
            rope.apply_(k, self.num_kv_heads)
            if shared_kv is not None:
                shared_kv[self.layer_index] = (k, v)
        rope.apply_(q, self.num_heads)
        out = backend.forward(self.kv_layer, q, k, v, meta, write=not self.kv_shared)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def _sharded_full_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.sharded_norm
        k_squares = k.float().square().sum((1, 2)) if norm.counts_k else k.new_zeros(k.shape[0], dtype=torch.float32)
        squares = torch.stack([q.float().square().sum((1, 2)), k_squares], dim=1)  # [T, 2]: this rank's share
        norm.all_reduce(squares)
        scale = torch.rsqrt(squares / squares.new_tensor([norm.q_width, norm.k_width]) + self.q_norm.eps)
        return tuple((x.float() * scale[:, i, None, None] * norm.weight.float().view(x.shape[1:])).to(x.dtype)
                     for i, (x, norm) in enumerate(((q, self.q_norm), (k, self.k_norm))))


class GatedMLP(nn.Module):
    """down(act(gate) * up): SwiGLU (silu), GeGLU (tanh-approximated gelu, Gemma), or gpt-oss's clamped SwiGLU
    (swiglu_oai, ModelConfig); or, ungated (gate_up holds up alone), down(relu(up)^2) (relu2, Nemotron-H's),
    down(gelu_tanh(up)) (StarCoder2's dense MLP) or down(gelu(up)) (BERT's)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool = False,
                 gated: bool = True) -> None:
        """intermediate_size: the width, where not the model's dense FFN's (an expert's); bias: on both
        projections (gpt-oss's experts, StarCoder2's MLP); gated False: up and down alone (relu2 always is)."""
        super().__init__()
        self.intermediate_size = width = intermediate_size or cfg.intermediate_size
        self.gated = gated and cfg.hidden_act != "relu2"
        self.gate_up = nn.Linear(cfg.hidden_size, (2 if self.gated else 1) * width, bias=bias)
        self.down = nn.Linear(width, cfg.hidden_size, bias=bias)
        self.activation = cfg.hidden_act
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.ops: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if not self.gated:
            if self.activation in ("gelu_tanh", "gelu"):  # StarCoder2's; BERT's exact (erf) GELU
                return self.down(F.gelu(gate_up, approximate="tanh" if self.activation == "gelu_tanh" else "none"))
            return self.down(torch.relu(gate_up).square())
        if self.ops is not None and self.activation == "silu":
            return self.down(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.activation == "swiglu_oai":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down(gate * torch.sigmoid(gate * self.alpha) * (up + 1))
        act = F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate)
        return self.down(act * up)


class ClassificationHead(nn.Module):
    """A sequence classifier's head over its first token's final state: out(tanh(dense(x))) (BERT's pooler then its
    classifier; RoBERTa's classifier, dense and out_proj)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(x)))


class DecoderLayer(nn.Module):
    """Pre-norm token mixer and MLP. The mixer is attention (an Attention, or latent attention: models/mla.py),
    held as `attn`, or a Mamba-2 state-space mixer (models/mamba.py), held as `ssm`. post_attn_norm is the MLP's
    input norm (HF llama's name for it); with sandwich norms (Gemma), the mixer's and the MLP's outputs are normed
    too before they join the residual, and without pre-norms (OLMo-2) only they are (the two input norms are
    ResidualAdds then); in Cohere's parallel block the MLP reads the mixer's normed input and the two outputs join
    as one branch. mlp is a GatedMLP, a mixture of experts (models/moe.py) in an MoE model's
    sparse layers, or None (Mamba-2's own layers hold the mixer alone)."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module, mlp: nn.Module | None, local: bool,
                 ssm: bool = False, nope: bool = False) -> None:
        """local: a layer of the model's local kind, whose rotary turns on the local base where it has one; nope: a
        layer whose attention takes no rotary (NoPE)."""
        super().__init__()
        self.post_norms = cfg.post_norms  # BERT's: only the two output norms below, each over the stream plus output
        self.input_norm = None if cfg.post_norms else make_norm(cfg) if cfg.pre_norms else ResidualAdd()
        self.attn = None if ssm else mixer
        self.ssm = mixer if ssm else None
        # Cohere's parallel block: the MLP reads the mixer's normed input, so has no norm of its own
        self.parallel = cfg.parallel_block
        self.post_attn_norm = (None if mlp is None or self.parallel or cfg.post_norms else make_norm(cfg)
                               if cfg.pre_norms else ResidualAdd())
        self.mlp = mlp
        self.attn_out_norm = (make_norm(cfg) if cfg.post_norms
                              else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None)
        self.mlp_out_norm = (make_norm(cfg) if cfg.post_norms
                             else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None)
        self.local, self.nope = local, nope
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each branch's output scaled before it joins
        # under tensor parallelism, each rank's mixer and MLP outputs are its partial sums: summed over the ranks
        # in place, here (cluster/collectives.py)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        # Gemma 4's end of a layer: a branch gated by the token's per-layer input (per-layer embeddings), then the
        # whole stream times the layer's scalar
        width = cfg.per_layer_input_size
        self.per_layer_gate = nn.Linear(cfg.hidden_size, width, bias=False) if width else None
        self.per_layer_projection = nn.Linear(width, cfg.hidden_size, bias=False) if width else None
        self.per_layer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if width else None
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalars else None
        self.activation = cfg.hidden_act

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope, backend, meta, states=None,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the previous layer's output, not yet added to the residual stream (or the embeddings: residual None,
        as after a layer that ends with the whole stream); states: the step's StateStep, for a state-space layer;
        shared_kv: a KV-sharing model's step k, v (Attention.forward); per_layer_input: this layer's slice of the
        per-layer embeddings [T, per_layer_input_size]."""
        if self.post_norms:
            return self._post_norm_layer(x, rope, backend, meta), None
        if residual is None:
            residual, x = x.float() if self.residual_in_fp32 else x, self.input_norm(x)
        else:
            x, residual = self.input_norm(x, residual)
        h = x
        if self.ssm is not None:
            x = self.ssm(h, states)
        else:
            x = self.attn(h, rope, backend, meta) if shared_kv is None else self.attn(h, rope, backend, meta, shared_kv)
        if self.parallel:  # the two outputs join the residual as one branch
            x = x + self.mlp(h)
        if self.all_reduce is not None:
            self.all_reduce(x)
        x = self.joining(x, self.attn_out_norm)
        if self.mlp is None or self.parallel:
            return x, residual
        x, residual = self.post_attn_norm(x, residual)
        x = self.mlp(x, residual) if getattr(self.mlp, "reads_stream", False) else self.mlp(x)
        if self.all_reduce is not None and not getattr(self.mlp, "reduces_its_output", False):
            self.all_reduce(x)
        x = self.joining(x, self.mlp_out_norm)
        if self.per_layer_gate is None and self.layer_scalar is None:
            return x, residual
        return self._gemma4_end(residual + x, per_layer_input), None

    def _post_norm_layer(self, stream: torch.Tensor, rope, backend, meta) -> torch.Tensor:
        """BERT's layer: the stream [T, hidden] plus attention's output, normed; that plus the MLP's, normed."""
        x = self.attn(stream, rope, backend, meta)
        if self.all_reduce is not None:
            self.all_reduce(x)
        stream = self.attn_out_norm(stream + x)
        x = self.mlp(stream)
        if self.all_reduce is not None:
            self.all_reduce(x)
        return self.mlp_out_norm(stream + x)

    def joining(self, x: torch.Tensor, out_norm: RMSNorm | None) -> torch.Tensor:
        """A mixer's or an MLP's output as it joins the residual stream: normed (sandwich norms), scaled (Granite's
        residual multiplier)."""
        if out_norm is not None:
            x = out_norm(x)
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x

    def _gemma4_end(self, stream: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """The whole stream [T, hidden] -> plus its per-layer branch, times the layer's scalar."""
        if self.per_layer_gate is not None:
            gate = self.per_layer_gate(stream)
            gate = F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate)
            stream = stream + self.per_layer_norm(self.per_layer_projection(gate * per_layer_input))
        return stream * self.layer_scalar if self.layer_scalar is not None else stream
