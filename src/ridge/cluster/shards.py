"""Which part of each weight a tensor-parallel rank holds, and the cutting of a loaded model down to it.

Attention is split by heads (latent attention's too, its latent and rotary key computed and cached whole on every
rank, as they are every head's): with at least as many KV heads as ranks, each rank takes whole KV heads with their
query heads (as evenly as the counts allow: SmolLM2's 3 KV heads over 2 ranks go 1 and 2); with fewer, each KV
head is replicated on the ranks that split its query heads between them. A rank's query heads then always share
its KV heads evenly, so its attention is an ordinary GQA over fewer heads. The MLP (and each expert) is split
along its intermediate width: gate and up by rows (column parallel), down by columns (row parallel); the
vocabulary by rows of the embedding table and the output projection. With expert parallelism, each rank holds
whole experts instead, its share of them; every rank routes every token, and runs the experts it holds. A
Mamba-2 mixer splits by heads as attention does, its groups of B and C in the place of KV heads, and a gated
DeltaNet by value heads, its query / key heads in that place. Gemma 4's global layers split their own KV heads (and
heads of their own width) as the windowed layers split theirs, every rank's query heads the same in both. Each rank's
attention and MLP outputs are then partial sums that one all-reduce each completes (cluster/collectives.py); norms
over a whole group or all heads (Mamba-2's where a group is split, OLMoE's q/k norms) sum their squares likewise.

A rank reads only its part of each weight from the file (ShardPlan.cut_model: the model cut on the meta device
first, the loader reading into its shapes); weights quantized at load are quantized whole (calibration runs the
whole model) and then cut. Either way every rank holds exactly the numbers a single process would: rows freely,
quantized columns only on the boundaries of their scale groups.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.models.gated_delta import GatedDeltaMixer
from ridge.models.layers import Attention, GatedMLP, ShardedFullNorm
from ridge.models.loader import VOCABULARY_TABLES, ShardCuts
from ridge.models.mamba import Mamba2Mixer
from ridge.models.mla import LatentAttention
from ridge.models.moe import MLPBesideExperts, MoEBlock
from ridge.quant.rtn import QuantizedWeight, cut_quantized, pad_rows

HEAD = "output_projection"  # quantize_weights' key of the output projection (quant/methods.py)
_EXPERT = re.compile(r"layers\.\d+\.mlp\.(?:moe\.)?experts\.(\d+)\.")


def even_ranges(n: int, parts: int) -> list[range]:
    """0..n-1 cut into `parts` consecutive ranges whose lengths differ by at most one."""
    return [range(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


@dataclass(frozen=True)
class HeadShard:
    q_heads: range
    kv_heads: range


def split_heads(num_heads: int, num_kv_heads: int, world: int, what: str = "attention heads") -> list[HeadShard]:
    """Each rank's query and KV heads (global indices). A state-space layer's heads split the same way, its
    groups (the heads that share B and C) in the place of KV heads."""
    if num_heads < world:
        raise ValueError(f"tensor_parallel_size: {world} ranks for {num_heads} {what} would leave a rank "
                         "without a head (heads are split, never cut); use at most "
                         f"{num_heads} ranks")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [HeadShard(range(kv.start * group, kv.stop * group), kv) for kv in even_ranges(num_kv_heads, world)]
    shards = []
    for head, ranks in enumerate(even_ranges(world, num_kv_heads)):  # num_heads >= world: len(ranks) <= group
        shards += [HeadShard(range(head * group + q.start, head * group + q.stop), range(head, head + 1))
                   for q in even_ranges(group, len(ranks))]
    return shards


def join_heads(parts: list[list[torch.Tensor]], shards: list[range] | None) -> list[torch.Tensor]:
    """Every rank's part of each cache tensor (AttentionBackend.read_blocks' form, KV heads along dim 1; the KV blocks
    engine/kv_transfer.py moves) -> the whole tensors: each head once, from the first rank that holds it (a head
    replicated over ranks is the same on each)."""
    if shards is None:
        return parts[0]
    whole = []
    for tensor in range(len(parts[0])):
        pieces, covered = [], 0
        for rank, heads in enumerate(shards):
            if heads.stop > covered:
                pieces.append(parts[rank][tensor][:, covered - heads.start:])
                covered = heads.stop
        whole.append(torch.cat(pieces, 1))
    return whole


def cut_heads(whole: list[torch.Tensor], shards: list[range] | None, ranks: int) -> list[list[torch.Tensor]]:
    """join_heads' inverse: each of the ranks' part of the whole tensors (views), by rank; with no shards every rank
    takes them whole."""
    if shards is None:
        return [whole] * ranks
    return [[t[:, heads.start:heads.stop] for t in whole] for heads in shards]


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: the split of every weight of a model of config `cfg`. granule: the column count a
    row-parallel cut must fall on a multiple of (the quantization group size where weights are quantized)."""

    cfg: ModelConfig
    rank: int
    world: int
    granule: int = 1
    expert_parallel: bool = False  # whole experts per rank, rather than a slice of each

    def __post_init__(self) -> None:
        cfg = self.cfg
        if self.expert_parallel and cfg.num_experts < self.world:
            raise ValueError(f"enable_expert_parallel: {cfg.architecture} has {cfg.num_experts} experts, fewer than "
                             f"the {self.world} ranks" if cfg.num_experts else
                             f"enable_expert_parallel: {cfg.architecture} has no experts")
        if cfg.attention_layers:
            windowed = split_heads(cfg.num_heads, cfg.num_kv_heads, self.world)  # raises where heads cannot be split
            if cfg.global_kv_heads:
                other = split_heads(cfg.num_heads, cfg.global_kv_heads, self.world, "global layers' heads")
                if [s.q_heads for s in windowed] != [s.q_heads for s in other]:
                    raise ValueError(
                        f"tensor_parallel_size: {self.world} ranks split the query heads of the windowed layers "
                        f"({cfg.num_kv_heads} KV heads) and the global layers ({cfg.global_kv_heads}) differently; use "
                        "a tensor_parallel_size that divides both KV head counts")
        if cfg.ssm_layers and cfg.state_mixer == "short_conv":
            raise ValueError("tensor_parallel_size: LFM2's short-convolution layers are not cut across ranks (run "
                             "it on one process)")
        if cfg.ssm_layers:
            self.ssm_heads  # noqa: B018 (raises where they cannot be split)
            if cfg.ssm_proj_bias:
                raise ValueError("tensor_parallel_size: a state-space layer's out_proj bias (row parallel) is not "
                                 "supported")
        for name, width in (("intermediate_size", cfg.intermediate_size),
                            ("moe_intermediate_size", cfg.moe_intermediate_size if cfg.num_experts else 0),
                            ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
            if width and width < self.world * self.granule:
                raise ValueError(f"tensor_parallel_size: {name} {width} cannot give each of {self.world} ranks "
                                 f"a multiple of {self.granule} columns")
        if cfg.attention_layers and self.granule > 1:
            # o_proj's input: the heads' values (Gemma 4's global layers: heads of their own width)
            value_dims = {cfg.v_head_dim} if cfg.is_mla else {cfg.head_dim, cfg.global_head_dim or cfg.head_dim}
            for shard, value_dim in itertools.product(split_heads(cfg.num_heads, cfg.num_kv_heads, self.world),
                                                      sorted(value_dims)):
                if (shard.q_heads.start * value_dim) % self.granule:
                    raise ValueError(
                        f"tensor_parallel_size: {self.world} splits o_proj's input at column "
                        f"{shard.q_heads.start * value_dim}, inside a quantization group of {self.granule} "
                        f"columns; choose a tensor_parallel_size (or, quantizing at load, a "
                        f"quantization_group_size) that divides it")

    @property
    def heads(self) -> HeadShard:
        return split_heads(self.cfg.num_heads, self.cfg.num_kv_heads, self.world)[self.rank]

    def layer_heads(self, layer: int) -> HeadShard:
        """This rank's heads in an attention layer: the model's, or those of the global layers' own KV heads
        (Gemma 4's; the same query heads, __post_init__ checks)."""
        cfg = self.cfg
        return split_heads(cfg.num_heads, cfg.layer_kv_heads(layer), self.world)[self.rank]

    @property
    def ssm_heads(self) -> HeadShard:
        """This rank's state-space heads (q_heads) and groups (kv_heads)."""
        return split_heads(self.cfg.ssm_num_heads, self.cfg.ssm_groups, self.world, "state-space heads")[self.rank]

    def local_config(self, cfg: ModelConfig | None = None) -> ModelConfig:
        """The model this rank computes: its heads, in `cfg` (the model's own config, which may differ from the
        plan's elsewhere: a window ignored at load) or the plan's."""
        cfg = cfg or self.cfg
        if cfg.attention_layers:
            heads, own = self.heads, {}
            if cfg.global_kv_heads:  # Gemma 4's global layers' own
                own = {"global_kv_heads": len(split_heads(cfg.num_heads, cfg.global_kv_heads, self.world)[self.rank]
                                              .kv_heads)}
            cfg = dataclasses.replace(cfg, num_heads=len(heads.q_heads), num_kv_heads=len(heads.kv_heads), **own)
        if cfg.ssm_layers:
            ssm = self.ssm_heads
            cfg = dataclasses.replace(cfg, ssm_num_heads=len(ssm.q_heads), ssm_groups=len(ssm.kv_heads))
        return cfg

    def pool_config(self, cfg: ModelConfig | None = None) -> ModelConfig:
        """A model of as many KV heads (and state-space heads and groups) as the rank with the most holds: what
        sizes each rank's KV blocks and state slots, so that every rank's pool has as many as rank 0 counts (in
        `cfg`, the model's own config, as local_config's)."""
        cfg = cfg or self.cfg
        if cfg.attention_layers:
            most = max(len(s.kv_heads) for s in split_heads(cfg.num_heads, cfg.num_kv_heads, self.world))
            heads = most * (cfg.num_heads // cfg.num_kv_heads)
            own = {}
            if cfg.global_kv_heads:  # Gemma 4's slots: as wide as the widest rank's windowed or global layer
                most_global = max(len(s.kv_heads) for s in split_heads(cfg.num_heads, cfg.global_kv_heads, self.world))
                # a head count both divide (a block's bytes count KV heads alone)
                heads = math.lcm(heads, most_global * (cfg.num_heads // cfg.global_kv_heads))
                own = {"global_kv_heads": most_global}
            cfg = dataclasses.replace(cfg, num_heads=heads, num_kv_heads=most, **own)
        if cfg.ssm_layers:
            shards = split_heads(cfg.ssm_num_heads, cfg.ssm_groups, self.world, "state-space heads")
            # every rank holds whole groups, or a part of one (split_heads): heads a multiple of groups either way
            cfg = dataclasses.replace(cfg, ssm_num_heads=max(len(s.q_heads) for s in shards),
                                      ssm_groups=max(len(s.kv_heads) for s in shards))
        return cfg

    def columns(self, width: int) -> torch.Tensor:
        """This rank's share of an intermediate width, in whole granules."""
        granules = even_ranges(width // self.granule, self.world)[self.rank]
        stop = width if self.rank == self.world - 1 else granules.stop * self.granule
        return torch.arange(granules.start * self.granule, stop)

    @property
    def vocab_shard(self) -> int:
        """Rows of the vocabulary each rank holds, the last one's padded with zero rows to the same count (so that
        the ranks' logits gather as equal pieces)."""
        return -(-self.cfg.vocab_size // self.world)

    def vocab_rows(self) -> torch.Tensor:
        first = self.rank * self.vocab_shard
        return torch.arange(first, min(first + self.vocab_shard, self.cfg.vocab_size))

    @property
    def held_experts(self) -> range:
        """The experts this rank runs: all of them (each cut by width), or under expert parallelism its share."""
        if not self.expert_parallel:
            return range(self.cfg.num_experts)
        return even_ranges(self.cfg.num_experts, self.world)[self.rank]

    def keeps(self, key: str) -> bool:
        """Whether this rank holds the weight at `key` (only the experts of other ranks it does not)."""
        match = _EXPERT.match(key)
        return match is None or int(match.group(1)) in self.held_experts

    def cut_model(self, model: nn.Module) -> ShardCuts:
        """Cut the meta-device model being loaded to this rank's part, and say which rows and columns of each weight
        the loader reads into it (models/loader.py's `shard`): the rank never holds the whole model."""
        cuts = shard_model(model, self)
        # a row-parallel layer's bias is added once, by rank 0 (its output is summed over the ranks): the others
        # read none
        others_bias = {f"{path}.bias" for path, (dim, _) in cuts.items() if dim == 1} if self.rank else set()
        return ShardCuts(cuts, self.vocab_shard, lambda key: self.keeps(key) and key not in others_bias)

    def weight_cuts(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
        """Module path -> (dim, indices) of every weight this rank holds a part of, keyed as quantize_weights keys
        them (and `embed_tokens`, `lm_head`): dim 0 cuts rows (output features), dim 1 columns (input features)."""
        cfg, heads = self.cfg, self.heads if self.cfg.attention_layers else None
        cuts: dict[str, tuple[int, torch.Tensor]] = {"embed_tokens": (0, self.vocab_rows()),
                                                     "lm_head": (0, self.vocab_rows()), HEAD: (0, self.vocab_rows())}
        if cfg.per_layer_input_size:  # Gemma 4's per-layer table: vocabulary parallel, as the embedding
            cuts["embed_per_layer"] = (0, self.vocab_rows())
        for i, layer in enumerate(model.layers):
            if isinstance(layer.attn, Attention) and heads is not None:
                shard = self.layer_heads(i)
                d = cfg.layer_head_dim(i)
                q, kv = cfg.num_heads * d, cfg.layer_kv_heads(i) * d
                q_rows = torch.arange(shard.q_heads.start * d, shard.q_heads.stop * d)
                kv_rows = torch.arange(shard.kv_heads.start * d, shard.kv_heads.stop * d)
                gate_rows = [q + 2 * kv + q_rows] if cfg.attention_output_gate else []  # the output gate's
                # a KV-shared layer projects q alone; a global layer whose values are its keys, q and k
                kv_parts = ([] if layer.attn.kv_shared else [q + kv_rows] if layer.attn.values_from_keys
                            else [q + kv_rows, q + kv + kv_rows])
                cuts[f"layers.{i}.attn.qkv"] = (0, torch.cat([q_rows, *kv_parts, *gate_rows]))
                cuts[f"layers.{i}.attn.o_proj"] = (1, q_rows)
                if cfg.attention_sinks:  # a logit per query head
                    cuts[f"layers.{i}.attn.sinks"] = (0, torch.arange(shard.q_heads.start, shard.q_heads.stop))
                if cfg.qk_norm_full:  # norms over all heads at once: a weight per row of q and of k
                    cuts[f"layers.{i}.attn.q_norm.weight"] = (0, q_rows)
                    cuts[f"layers.{i}.attn.k_norm.weight"] = (0, kv_rows)
                elif cfg.qk_norm and cfg.norm_kind == "layer":  # Command R+'s: a weight row for each head
                    cuts[f"layers.{i}.attn.q_norm.weight"] = (0, torch.arange(shard.q_heads.start, shard.q_heads.stop))
                    cuts[f"layers.{i}.attn.k_norm.weight"] = (0, torch.arange(shard.kv_heads.start,
                                                                              shard.kv_heads.stop))
            elif isinstance(layer.attn, LatentAttention) and heads is not None:
                # the latent and the rotary key (kv_a, q_a) are every head's: each rank computes and caches them whole
                q_width, kv_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
                query = "q_b" if cfg.q_lora_rank else "q_proj"
                cuts[f"layers.{i}.attn.{query}"] = (0, _head_rows(heads.q_heads, q_width))
                cuts[f"layers.{i}.attn.kv_b"] = (0, _head_rows(heads.q_heads, kv_width))
                cuts[f"layers.{i}.attn.o_proj"] = (1, _head_rows(heads.q_heads, cfg.v_head_dim))
            if isinstance(layer.ssm, Mamba2Mixer):
                cuts.update(self._ssm_cuts(f"layers.{i}.ssm"))
            elif isinstance(layer.ssm, GatedDeltaMixer):
                cuts.update(self._gated_delta_cuts(f"layers.{i}.ssm"))
            mlps = {"mlp": layer.mlp} if isinstance(layer.mlp, GatedMLP) else {}
            if isinstance(layer.mlp, MLPBesideExperts):
                mlps = {"mlp.mlp": layer.mlp.mlp}
            if (moe := mixture_of(layer)) is not None:
                path = "mlp.moe" if isinstance(layer.mlp, MLPBesideExperts) else "mlp"
                if not self.expert_parallel:  # under expert parallelism, a rank's experts stay whole
                    mlps.update({f"{path}.experts.{e}": expert for e, expert in enumerate(moe.experts)})
                if moe.shared_expert is not None:
                    mlps[f"{path}.shared_expert"] = moe.shared_expert
            for name, ffn in mlps.items():
                cols = self.columns(ffn.intermediate_size)
                # a gated FFN's gate_up holds its gate's rows, then its up's; an ungated one's, up's alone
                rows = torch.cat([cols, ffn.intermediate_size + cols]) if ffn.gated else cols
                cuts[f"layers.{i}.{name}.gate_up"] = (0, rows)
                cuts[f"layers.{i}.{name}.down"] = (1, cols)
        return cuts


    def _ssm_cuts(self, path: str) -> dict[str, tuple[int, torch.Tensor]]:
        """A Mamba-2 mixer's parts on this rank: its heads' rows of z, x, dt and their parameters, its groups'
        rows of B and C, the convolution's channels (x, B, C) to match; out_proj by its heads' columns."""
        cfg, shard = self.cfg, self.ssm_heads
        inner, bc = cfg.ssm_inner_size, cfg.ssm_groups * cfg.ssm_state_size
        x_rows = _head_rows(shard.q_heads, cfg.ssm_head_dim)
        b_rows = _head_rows(shard.kv_heads, cfg.ssm_state_size)
        heads = torch.arange(shard.q_heads.start, shard.q_heads.stop)
        channels = torch.cat([x_rows, inner + b_rows, inner + bc + b_rows])  # the convolution's x | B | C
        return {f"{path}.in_proj": (0, torch.cat([x_rows, inner + channels, 2 * inner + 2 * bc + heads])),
                f"{path}.out_proj": (1, x_rows), f"{path}.conv_weight": (0, channels),
                f"{path}.conv_bias": (0, channels), f"{path}.norm_weight": (0, x_rows),
                **{f"{path}.{name}": (0, heads) for name in ("dt_bias", "A_log", "D")}}

    def _gated_delta_cuts(self, path: str) -> dict[str, tuple[int, torch.Tensor]]:
        """A gated DeltaNet on this rank: its groups' rows of q and k, its value heads' rows of v, z, b and alpha
        and their dt_bias and A, the convolution's channels (q, k, v) to match; out_proj by its value heads'
        columns. (The per-head norm needs no sum across ranks.)"""
        cfg, shard = self.cfg, self.ssm_heads
        keys, width, heads = cfg.ssm_groups * cfg.ssm_state_size, cfg.ssm_head_dim, self.value_heads()
        v_rows = (heads[:, None] * width + torch.arange(width)).flatten()
        q_rows = _head_rows(shard.kv_heads, cfg.ssm_state_size)
        channels = torch.cat([q_rows, keys + q_rows, 2 * keys + v_rows])  # the convolution's q | k | v
        z = cfg.ssm_conv_channels
        b = z + cfg.ssm_inner_size
        rows = torch.cat([channels, z + v_rows, b + heads, b + cfg.ssm_num_heads + heads])
        return {f"{path}.in_proj": (0, rows), f"{path}.out_proj": (1, v_rows), f"{path}.conv_weight": (0, channels),
                f"{path}.dt_bias": (0, heads), f"{path}.A_log": (0, heads)}

    def value_heads(self) -> torch.Tensor:
        """This rank's gated DeltaNet value heads (global indices) in the order its mixer holds them: split_heads'
        (groups and their heads in HF's grouped order); in a GGUF's tiled order, where a group's heads are every
        groups-th, sorted so that the rank's own are tiled over its groups again."""
        cfg, shard = self.cfg, self.ssm_heads
        grouped = torch.arange(shard.q_heads.start, shard.q_heads.stop)
        if not cfg.ssm_heads_tiled:
            return grouped
        per_group = cfg.ssm_num_heads // cfg.ssm_groups
        tiled = grouped % per_group * cfg.ssm_groups + grouped // per_group
        return tiled.sort().values


def mixture_of(layer: nn.Module) -> MoEBlock | None:
    """A layer's mixture of experts: its MLP, or the one beside its dense MLP (Gemma 4's 26B-A4B)."""
    mlp = layer.mlp
    return mlp if isinstance(mlp, MoEBlock) else mlp.moe if isinstance(mlp, MLPBesideExperts) else None


def _head_rows(heads: range, width: int) -> torch.Tensor:
    return torch.arange(heads.start * width, heads.stop * width)


def shard_model(model: nn.Module, plan: ShardPlan) -> dict[str, tuple[int, torch.Tensor]]:
    """Cut the model's dense weights down to this rank's parts in place, its heads and widths with them; return
    the cuts (for the weights quantized at load: shard_quantized). On the meta device, before any weight is read,
    it gives the shapes of the rank's part that the loader reads the file into (ShardPlan.cut_model)."""
    cuts = plan.weight_cuts(model)
    for path, (dim, index) in cuts.items():
        module = getattr(model, path, None) if "." not in path else _get(model, path)
        if module is None:
            continue
        if isinstance(module, nn.Parameter):  # MLA's kv_b, a parameter of its own (never quantized)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, nn.Parameter(module.data.index_select(dim, index),
                                                                    requires_grad=False))
            continue
        _cut_module(module, dim, index, plan.vocab_shard if path in VOCABULARY_TABLES else None,
                    keeps_bias=plan.rank == 0)
    local = plan.local_config(model.cfg)
    for layer in model.layers:
        if (moe := mixture_of(layer)) is not None and plan.expert_parallel:
            moe.held = plan.held_experts
            for e in range(len(moe.experts)):
                if e not in plan.held_experts:
                    moe.experts[e] = nn.Module()  # another rank's expert: its weights freed here
        if isinstance(layer.attn, Attention):
            layer.attn.num_heads = local.num_heads
            layer.attn.num_kv_heads = local.layer_kv_heads(layer.attn.layer_index)
            if plan.cfg.qk_norm_full:
                heads, group = plan.heads, plan.cfg.num_heads // plan.cfg.num_kv_heads
                layer.attn.sharded_norm = ShardedFullNorm(
                    plan.cfg.num_heads * plan.cfg.head_dim, plan.cfg.num_kv_heads * plan.cfg.head_dim,
                    counts_k=heads.q_heads.start == heads.kv_heads.start * group)  # the KV heads' first rank
        elif isinstance(layer.attn, LatentAttention):
            layer.attn.num_heads = local.num_heads
        elif isinstance(layer.ssm, Mamba2Mixer):
            layer.ssm.shard(local, plan.ssm_heads.kv_heads, plan.cfg, plan.world)
        elif isinstance(layer.ssm, GatedDeltaMixer):
            layer.ssm.shard(local)
        for module in layer.modules() if layer.mlp is not None else ():
            if isinstance(module, GatedMLP):
                down = module.down
                module.intermediate_size = down.weight.shape[1] if isinstance(down, nn.Linear) else down.in_features
    model.cfg = local
    return cuts


def _get(model: nn.Module, path: str) -> nn.Module | nn.Parameter:
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent), name)


def _cut_module(module: nn.Linear | nn.Embedding, dim: int, index: torch.Tensor, pad_to: int | None,
                keeps_bias: bool) -> None:
    """keeps_bias: whether a row-parallel layer (dim 1) keeps its bias, whole: on one rank only, since the ranks'
    outputs are summed."""
    weight = module.weight.data.index_select(dim, index)
    if pad_to is not None:
        weight = pad_rows(weight, pad_to)
    module.weight = nn.Parameter(weight, requires_grad=False)
    bias = getattr(module, "bias", None)
    if bias is not None:
        module.bias = (bias if keeps_bias else None) if dim == 1 else nn.Parameter(bias.data.index_select(0, index),
                                                                                    requires_grad=False)


def shard_quantized(key: str, weight: QuantizedWeight, cuts: dict[str, tuple[int, torch.Tensor]],
                    pad_to: int) -> QuantizedWeight:
    """This rank's part of a quantized weight (as quantized whole), cut as its dense weight is; the output
    projection's padded with zero rows to pad_to."""
    if key not in cuts:
        return weight
    dim, index = cuts[key]
    return cut_quantized(key, weight, dim, index, pad_to if key == HEAD else None)
