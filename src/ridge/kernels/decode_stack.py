"""A decode step's decoder layers in one C++ call (kernels/decode_stack.cpp): the CPU's CUDA graph.

At batch 1 a layer is ~10 kernel calls of a few microseconds each, and the Python between them costs nearly
as much again (docs/notes/kernel-choices.md). The C++ stack calls the same kernels in the same order, so its
outputs are bit-identical to models/layers.py's; it is built once per engine from the model's modules
(references, not copies) and serves the steps it can: decodes only (no prefill chunk, no draft verification),
each row reading its own blocks (no shared prefix attended once), on the paged backend's kernels (or the
quantized cache's: int8 / fp8 / int4 codes written and read in C++, or latent attention's rows), float32 or bfloat16,
at most MAX_ROWS rows (fewer than TILED_MIN_ROWS where bfloat16 4-bit layers on torch's layout change kernel
there). A mixture of experts' layers route and run their experts in C++ too (decode_stack.h's Experts), side by
side on the threads. Each layer reads its own KV group's part of the step (its window, its blocks), so local:global
models (Gemma 3, gpt-oss) are served too, with their own rotary bases, sandwich norms and attention sinks; Gemma 4's
layers of two head shapes, its KV-shared layers reading their source layers' caches, its per-layer embeddings'
branch and layer scalars; and
Mamba-2's layers, each mixer advancing the rows' states in their slots (kernels/state_space.cpp), its residual
stream in float32 where the model keeps it so; LFM2's short convolutions and Qwen3.5's gated DeltaNet and gated
attention likewise (torch ops in the Python form's order).
Every other step, and every model with a layer it has no kernel for, runs the Python path, as does
`enforce_eager=True` (vLLM's name for running without captured graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ridge.attention.backend import AttentionBackend, AttentionMetadata, StepMetadata
from ridge.attention.latent import LatentBackend
from ridge.attention.paged import PagedBackend
from ridge.attention.quantized_kv import QuantizedKVBackend
from ridge.config import ModelConfig
from ridge.kv.state_cache import StateCache, StateStep
from ridge.linear import Int4Linear, native_linear
from ridge.linear.rows import FEW_ROWS, INT8_ACTIVATIONS_MAX_ROWS, TILED_MIN_ROWS
from ridge.models.gated_delta import GatedDeltaMixer
from ridge.models.layers import Attention, DecoderLayer, GatedMLP, L2Norm, LayerNorm, RMSNorm
from ridge.models.mamba import Mamba2Mixer
from ridge.models.mla import LatentAttention
from ridge.models.moe import MLPBesideExperts, MoEBlock
from ridge.models.short_conv import ShortConvMixer
from ridge.models.transformer import DecoderModel
from ridge.rope_scaling import AttentionTemperature

log = logging.getLogger("ridge")

# the rows the Python path keeps on the kernels the stack calls: dense layers' few-row one, the integer one
MAX_ROWS = min(FEW_ROWS, INT8_ACTIVATIONS_MAX_ROWS)


class DecodeStack:
    def __init__(self, native: Any, max_rows: int = MAX_ROWS, ops: ModuleType | None = None,
                 state_space: bool = False, temperature: AttentionTemperature | None = None,
                 max_table_blocks: int | None = None,
                 per_layer_inputs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.native = native
        self.per_layer_inputs = per_layer_inputs  # the model's (DecoderModel.per_layer_inputs), where it has them
        self.temperature = temperature  # the model's: each row's queries scaled by its position
        self.max_rows = max_rows  # up to which the Python path keeps the kernels the stack calls
        self.native_ops = ops
        self.state_space = state_space  # the model has state-space layers: a step's rows come with state slots
        # sparse attention's top k in whole blocks: the stack attends to every key, which is the indexer's choice
        # while the decodes' tables hold no more tokens than it (models/sparse_index.py makes none then)
        self.max_table_blocks = max_table_blocks

    def serves(self, step: StepMetadata, states: StateStep | None) -> bool:
        """Whether this step is the stack's: decodes only, every KV group's rows and state slots read in place."""
        if self.state_space and (states is None or states.chunks or not 0 < states.num_decodes <= self.max_rows):
            return False
        return all(self._serves(meta) for meta in step)

    def _serves(self, meta: AttentionMetadata) -> bool:
        kernel = meta.kernel_rows
        return (not meta.prefills and 0 < meta.num_decodes <= self.max_rows
                and meta.slot_mapping.shape[0] == meta.num_decodes  # no drafts scored
                and kernel is not None and kernel.rows is None and not kernel.shared_prefixes
                and (self.max_table_blocks is None or meta.decode_block_tables.shape[1] <= self.max_table_blocks))

    def __call__(self, input_ids: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                 step: StepMetadata, states: StateStep | None = None) -> torch.Tensor:
        """The tokens [B] of a step that serves() and their embeddings [B, hidden] -> the final norm's output
        [B, hidden]."""
        groups = [self.native_ops.GroupStep(meta.slot_mapping, meta.kernel_rows.block_tables,
                                            meta.kernel_rows.context_lens, meta.kernel_rows.window_starts,
                                            meta.attention_mass)
                  for meta in step]
        scales = self.temperature.query_scales(positions) if self.temperature is not None else None
        per_layer = self.per_layer_inputs(input_ids, embeddings) if self.per_layer_inputs is not None else None
        return self.native.forward(embeddings, positions, groups, states.slots if self.state_space else None, scales,
                                   per_layer)


def native_experts(ops: ModuleType, moe: MoEBlock) -> Any:
    """The stack's form of a mixture of experts (ops.Experts), or None where an expert has no kernel there. An
    expert another rank holds (expert parallelism) has no parts: the stack skips it as MoEBlock does."""
    def pair(mlp: GatedMLP) -> tuple[Any, Any] | None:
        gate_up, down = native_linear(ops, mlp.gate_up), native_linear(ops, mlp.down)
        return None if gate_up is None or down is None else (gate_up, down)

    if not moe.native_activation:
        return None
    empty = ops.Linear([], None)
    experts = [pair(e) if i in moe.held else (empty, empty) for i, e in enumerate(moe.experts)]
    shared = pair(moe.shared_expert) if moe.shared_expert is not None else (None, None)
    if any(e is None for e in experts) or shared is None:
        return None
    gate = moe.shared_expert_gate
    mlp = moe.experts[moe.held[0]] if len(moe.held) else moe.shared_expert
    return ops.Experts(moe.router.weight, moe.router_bias, moe.top_k, moe.groups, moe.topk_groups, moe.sigmoid,
                       moe.renormalize, moe.group_rating == "top2", moe.scaling, [e[0] for e in experts],
                       [e[1] for e in experts], *shared, None if gate is None else gate.weight,
                       router_logit_bias=moe.router.bias,
                       activation=native_activation(ops, mlp) if mlp is not None else ops.Activation("silu"),
                       norm_eps=moe.norm_eps, scale_input=moe.scales_input, router_input_scale=moe.router_input_scale,
                       expert_scales=moe.expert_scales, router_input_eps=moe.norm_eps_input)


def native_activation(ops: ModuleType, mlp: GatedMLP) -> Any:
    """The stack's form of an MLP's activation (ops.Activation), gated or not."""
    clamped = mlp.activation == "swiglu_oai"  # gpt-oss's: its limit and alpha
    return ops.Activation(mlp.activation, mlp.limit if clamped else 0.0, mlp.alpha if clamped else 1.0, mlp.gated)


def latent_projections(ops: ModuleType, attn: LatentAttention, index_cache: torch.Tensor | None = None) -> Any:
    """The stack's form of a latent attention's projections (ops.LatentProjections), with its indexer's key and
    that key's cache where it has sparse attention's indexer; None where one has no kernel there."""
    bottleneck = hasattr(attn, "q_a")
    linears = [native_linear(ops, m) for m in ((attn.q_a, attn.q_b) if bottleneck else (attn.q_proj,))]
    kv_a = native_linear(ops, attn.kv_a)
    index_key = None
    if attn.indexer is not None:
        if (wk := native_linear(ops, attn.indexer.wk)) is None:
            return None
        norm = attn.indexer.k_norm
        index_key = ops.IndexerKey(wk, norm.weight, norm.bias, index_cache)
    if kv_a is None or any(linear is None for linear in linears):
        return None
    up = attn.kv_b.view(attn.num_heads, attn.nope + attn.v_dim, attn.rank)
    return ops.LatentProjections(linears[0] if bottleneck else None, attn.q_a_norm.weight if bottleneck else None,
                                 linears[-1], kv_a, attn.kv_a_norm.weight, up[:, :attn.nope], up[:, attn.nope:],
                                 attn.rope, index_key)


def attach_native_experts(model: DecoderModel, ops: ModuleType) -> None:
    """Give each mixture-of-experts block of `model` its C++ form, which its forward() calls on steps of up to
    as many rows as the stack takes (decode steps the stack does not serve: a tensor-parallel rank's OLMoE, its
    q / k norms summed over the ranks); a block with an expert that has no kernel there keeps its Python path."""
    for block in model.modules():
        if isinstance(block, MoEBlock):
            block.native, block.native_max_rows = native_experts(ops, block), max_rows(model)
    if any(isinstance(b, MoEBlock) and not b.native_activation for b in model.modules()):
        log.warning("ridge: the C++ experts have no %s activation; the mixture's experts run in Python",
                    model.cfg.hidden_act)


def max_rows(model: DecoderModel) -> int:
    """The most rows the stack's kernel calls keep the Python path's kernels for."""
    # bfloat16's 4-bit layers on torch's layout change kernel at TILED_MIN_ROWS (linear/quantized.py)
    int4pack = any(isinstance(m, Int4Linear) for m in model.layers.modules())
    return min(MAX_ROWS, TILED_MIN_ROWS - 1) if int4pack else MAX_ROWS


def build(model: DecoderModel, backend: AttentionBackend, ops: ModuleType | None, tensor_parallel: bool = False,
          states: StateCache | None = None) -> DecodeStack | None:
    """The stack over model's layers and backend's caches (and the state-space layers' `states`), or None where
    the Python path must serve. tensor_parallel: the model is a rank's shard; the stack sums its layers' partial
    outputs over the ranks with the all-reduce the layers are given (cluster/collectives.py), at call time: rank
    0's are given after its runner is made."""
    cfg = model.cfg
    quantized = isinstance(backend, QuantizedKVBackend)
    kernels = {PagedBackend: backend.ops is not None, QuantizedKVBackend: quantized and backend.kernels is not None,
               LatentBackend: isinstance(backend, LatentBackend) and backend.kernel}
    if ops is None or not kernels.get(type(backend), False):
        return None
    mixers = [layer.ssm for layer in model.layers if layer.ssm is not None]
    unsupported = [what for what, present in (
        ("q / k norms over all heads cut across ranks",
         any(isinstance(layer.attn, Attention) and layer.attn.sharded_norm is not None for layer in model.layers)),
        ("state-space groups cut across ranks",
         any(isinstance(m, Mamba2Mixer) and m.shared_group is not None for m in mixers)),
        # a layer of its own head shape runs in gemma4_attention alone, which reads the layer's shape
        ("layers of different head widths outside Gemma 4's attention", not cfg.uniform_attention and any(
            isinstance(layer.attn, Attention) and not layer.attn.gemma4 for layer in model.layers))) if present]
    if unsupported:
        log.warning("ridge: the fused decode step has no %s; decode runs layer by layer", ", ".join(unsupported))
        return None
    dtype = model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or backend.dtype != dtype:
        return None
    layers = []
    for i, layer in enumerate(model.layers):
        if layer.ssm is not None:
            if (native := state_space_layer(ops, layer, states)) is None:
                log.debug("ridge: decode stack off: layer %d's mixer has a linear without a kernel there", i)
                return None
            layers.append(native)
            continue
        attn, mlp = layer.attn, layer.mlp
        beside = mlp if isinstance(mlp, MLPBesideExperts) else None  # Gemma 4 26B-A4B's: a dense MLP beside experts
        if beside is not None:
            mlp = beside.mlp
        block = beside.moe if beside is not None else mlp if isinstance(mlp, MoEBlock) else None
        moe = block is not None and beside is None  # the layer's MLP is the experts alone
        experts = ((block.native if block.native is not None else native_experts(ops, block)) if block is not None
                   else None)
        latent = isinstance(attn, LatentAttention)
        # a latent layer's projections are its LatentProjections; its qkv is empty
        linears = [ops.Linear([], None) if latent else native_linear(ops, attn.qkv), native_linear(ops, attn.o_proj)]
        # a mixture's layer, or one without an MLP (Nemotron-H's), has no dense MLP: its gate_up and down are empty
        linears += ([ops.Linear([], None)] * 2 if moe or mlp is None
                    else [native_linear(ops, m) for m in (mlp.gate_up, mlp.down)])
        projections = latent_projections(ops, attn, backend.index_keys.get(i)) if latent else None
        end = _gemma4_end(ops, layer, cfg)
        if (any(linear is None for linear in linears) or (block is not None and experts is None)
                or (latent and projections is None) or end is None):
            log.debug("ridge: decode stack off: layer %d has a linear without a kernel there", i)
            return None
        norms = (None, None) if latent or attn.q_norm is None else _qk_norm_weights(attn, dtype)
        source = attn.kv_layer if isinstance(attn, Attention) else i  # a KV-shared layer's: another layer's caches
        cache = ((backend.k_scales[source], backend.v_scales[source], backend.key_centers.get(source),
                  backend.format.name == "fp8") if quantized else ())
        rotary = model.layer_rotary(layer)  # Gemma 3's local layers turn on their own base; NoPE layers on none
        sandwich = layer.attn_out_norm is not None
        layers.append(ops.Layer(_norm_weight(layer.input_norm), _norm_weight(layer.post_attn_norm), *norms, *linears,
                                backend.k_cache[source], backend.v_cache[source], *cache, experts=experts,
                                latent=projections,
                                activation=(ops.Activation("silu") if moe or mlp is None
                                            else native_activation(ops, mlp)),
                                group=backend.group_of_layer[source],
                                rope_table=None if rotary is model.rotary else torch.view_as_real(rotary.freqs),
                                sinks=None if latent else attn.sinks,
                                attn_out_norm=layer.attn_out_norm.weight if sandwich else None,
                                mlp_out_norm=layer.mlp_out_norm.weight if sandwich else None,
                                residual_multiplier=layer.residual_multiplier,
                                output_gate=isinstance(attn, Attention) and attn.gated, parallel=layer.parallel,
                                tempered=rotary.temperature is not None,
                                input_norm_bias=_norm_bias(layer.input_norm),
                                post_attn_norm_bias=_norm_bias(layer.post_attn_norm),
                                **({} if latent else _gemma4_attention(attn)), **end,
                                **({} if beside is None else dict(beside_mlp_norm=beside.mlp_out_norm.weight,
                                                                  experts_in_norm=beside.experts_in_norm.weight,
                                                                  experts_out_norm=beside.experts_out_norm.weight))))
    rope_table = torch.view_as_real(model.rotary.freqs)
    first = model.layers[0]
    all_reduce = (lambda x: first.all_reduce(x)) if tensor_parallel else None
    return DecodeStack(ops.DecodeStack(layers, model.norm.weight, rope_table, cfg.num_heads, cfg.num_kv_heads,
                                       cfg.head_dim, cfg.rms_norm_eps, backend.scale, all_reduce,
                                       cfg.residual_in_fp32, cfg.norm_kind == "layer", _norm_bias(model.norm)),
                       max_rows(model), ops, state_space=bool(mixers), temperature=cfg.attention_temperature,
                       max_table_blocks=_sparse_attention_blocks(cfg, backend.block_size),
                       per_layer_inputs=model.per_layer_inputs if model.embed_per_layer is not None else None)


def _gemma4_attention(attn: Attention) -> dict:
    """The Layer fields of Gemma 4's attention (Attention._forward_gemma4's): its own head shape, values from keys,
    v norms, a KV-shared layer's source; none for every other attention."""
    if not attn.gemma4:
        return {}
    return dict(kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, gemma4=True,
                values_from_keys=attn.values_from_keys, kv_shared=attn.kv_shared)


def _gemma4_end(ops: ModuleType, layer: DecoderLayer, cfg: ModelConfig) -> dict | None:
    """The Layer fields of Gemma 4's end of a layer (DecoderLayer._gemma4_end's): its per-layer branch, its scalar;
    None where a linear of the branch has no kernel there."""
    ends = {"layer_scalar": layer.layer_scalar} if layer.layer_scalar is not None else {}
    if layer.per_layer_gate is None:
        return ends
    gate, projection = native_linear(ops, layer.per_layer_gate), native_linear(ops, layer.per_layer_projection)
    if gate is None or projection is None:
        return None
    return {**ends, "per_layer_gate": gate, "per_layer_projection": projection,
            "per_layer_norm": layer.per_layer_norm.weight,
            "per_layer_activation": ops.Activation("gelu_tanh" if cfg.hidden_act == "gelu_tanh" else "silu", 0.0, 1.0,
                                                   False)}


def _sparse_attention_blocks(cfg: ModelConfig, block_size: int) -> int | None:
    """The most blocks a decode's table may hold for the stack to serve it (None: any): sparse attention's top k,
    past which its indexer chooses keys the stack does not, and the Python path decodes."""
    if not cfg.index_topk:
        return None
    log.warning("ridge: decode steps whose tables pass sparse attention's top %d keys run layer by layer in Python "
                "(the fused decode step makes no indexer choice)", cfg.index_topk)
    return cfg.index_topk // block_size


def state_space_layer(ops: ModuleType, layer: DecoderLayer, states: StateCache) -> Any:
    """The stack's form of a layer whose mixer is Mamba-2's, LFM2's short convolution or Qwen3.5's gated DeltaNet
    (its dense MLP or its mixture of experts, where it has one), over its state tensors; None where a linear has no
    kernel there."""
    mixer = layer.ssm
    in_proj, out_proj = native_linear(ops, mixer.in_proj), native_linear(ops, mixer.out_proj)
    mlp = layer.mlp
    moe = isinstance(mlp, MoEBlock)
    experts = (mlp.native if mlp.native is not None else native_experts(ops, mlp)) if moe else None
    mlp_linears = [native_linear(ops, m) for m in (mlp.gate_up, mlp.down)] if mlp is not None and not moe else [
        ops.Linear([], None)] * 2
    if in_proj is None or out_proj is None or any(linear is None for linear in mlp_linears) or (
            moe and experts is None):
        return None
    conv_state, ssm_state = states.conv[mixer.layer_index], states.ssm[mixer.layer_index]
    if isinstance(mixer, ShortConvMixer):
        kind, native = "short_conv", ops.ShortConv(in_proj, out_proj, mixer.conv_weight, mixer.conv_bias, conv_state)
    elif isinstance(mixer, GatedDeltaMixer):
        kind, native = "gated_delta", ops.GatedDelta(in_proj, out_proj, mixer.conv_weight, mixer.conv_bias,
                                                     mixer.dt_bias, mixer.A_log, mixer.norm_weight, mixer.groups,
                                                     mixer.tiled, conv_state, ssm_state)
    else:
        kind, native = "ssm", ops.StateMixer(in_proj, out_proj, mixer.conv_weight, mixer.conv_bias, mixer.dt_bias,
                                             mixer.A_log, mixer.D, mixer.norm_weight, mixer.groups, *mixer.dt_limit,
                                             conv_state, ssm_state)
    empty = torch.empty(0)
    return ops.Layer(_norm_weight(layer.input_norm), _norm_weight(layer.post_attn_norm), None, None,
                     ops.Linear([], None), ops.Linear([], None), *mlp_linears, empty, empty,
                     experts=experts,
                     activation=ops.Activation("silu") if mlp is None or moe else native_activation(ops, mlp),
                     attn_out_norm=None if layer.attn_out_norm is None else layer.attn_out_norm.weight,
                     mlp_out_norm=None if layer.mlp_out_norm is None else layer.mlp_out_norm.weight,
                     residual_multiplier=layer.residual_multiplier,
                     **{kind: native})


def _qk_norm_weights(attn: Attention, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An attention layer's q and k norms' weights; Llama 4's norms have none, they multiply by ones; a KV-shared
    layer (Gemma 4's) norms no k."""
    if attn.kv_shared:
        return attn.q_norm.weight, None
    if isinstance(attn.q_norm, L2Norm):
        ones = torch.ones(attn.head_dim, dtype=dtype)
        return ones, ones
    return attn.q_norm.weight, attn.k_norm.weight


def _norm_weight(norm: nn.Module | None) -> torch.Tensor | None:
    """A pre-norm's weight; None where the layer has none there (OLMo-2's ResidualAdd, or no MLP)."""
    return norm.weight if isinstance(norm, RMSNorm) else None


def _norm_bias(norm: nn.Module | None) -> torch.Tensor | None:
    """A LayerNorm's bias (StarCoder2's); None for every other norm."""
    return norm.bias if isinstance(norm, LayerNorm) else None
