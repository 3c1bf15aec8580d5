"""A cached prompt prefix's KV moved between two engines of the same model: disaggregated prefill and decode.

A prefill engine runs a prompt, then exports the full blocks of it that its prefix cache holds (their K and V
tensors, block by block, in its cache's own layout); a decode engine adopts them into its prefix cache, keyed by the
same chained hashes of the same tokens (kv/prefix_cache.py), so that the request it then receives finds the prompt
cached and computes only the tokens after the last full block, as any prefix-cache hit does. The tokens are the
colocated run's by construction: a block that did not arrive (evicted before the export, or no room to adopt it)
is computed again, never guessed.

Blocks travel whole, every KV head of the model once, so that the two sides may split the model across different
numbers of ranks (a prefill server of 2 ranks feeding a decode server of 1, say): each rank of a tensor-parallel
engine holds its own KV heads' part of every block (cluster/shards.py), so an export gathers every rank's part on
rank 0 and joins them by head, and an import sends the whole blocks to every rank once, each writing its own heads.
A state-space model's snapshots do not travel (refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.cluster.shards import cut_heads, join_heads, split_heads
from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine


@dataclass
class PrefixBlocks:
    """Whole blocks of one prompt's cached prefix, in the exporting engine's cache layout: of each KV group (a
    full-attention group every block of the prefix, a sliding-window group those of the window at its end), one
    group after the other."""

    token_ids: list[int]  # the tokens they hold: num_blocks blocks of block_size each
    salt: str | None  # the request's cache_salt (keys chain from it)
    block_size: int
    # per cache tensor, AttentionBackend.read_blocks' form [rows, ...] with every KV head of the model (a one-process
    # engine's tensors as they are)
    data: list[torch.Tensor]
    groups: list[list[int]] | None = None  # per KV group, the prefix's blocks it sent, in data's order (None: one
    # full-attention group, all of them)

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = [list(range(self.num_blocks))]

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.data)


def check_config(config: EngineConfig, role: str) -> None:
    """ValueError naming what keeps an engine of this config from moving cached prefixes (before it loads)."""
    if not config.enable_prefix_caching:
        raise ValueError(f"role: {role} moves prefix-cache blocks; enable_prefix_caching must be on")
    if config.device != "cpu":
        raise ValueError(f"role: {role} runs on the CPU so far (device=cpu)")
    if config.enable_lora:
        raise ValueError(f"role: {role} moves the base model's blocks; an adapter's KV does not move yet (serve "
                         "LoRA adapters colocated, without --enable-lora on this role)")


def check_transferable(engine: LLMEngine) -> None:
    """ValueError naming what keeps this engine from moving cached prefixes."""
    check_config(engine.config, "disaggregated prefill")
    if engine.kv.cache is None:
        raise ValueError("role: disaggregated prefill moves prefix-cache blocks, and this engine keeps no prefix "
                         "cache")
    if engine.loaded.config.ssm_layers:
        raise ValueError("role: disaggregated prefill moves KV blocks, not the snapshots of a state-space model's "
                         "recurrent state its prefixes resume from (kv/state_snapshots.py); serve it colocated")


def kv_head_shards(engine: LLMEngine) -> list[range] | None:
    """Each rank's KV heads (global indices) where the engine's blocks split by heads across ranks; None where every
    rank holds them whole (one process; latent attention's rows, every head's)."""
    cfg, world = engine.loaded.config, engine.config.tensor_parallel_size
    if world == 1 or cfg.is_mla:
        return None
    if not cfg.uniform_attention:
        raise ValueError("tensor_parallel_size: a model whose layers' KV heads differ (Gemma 4's) packs its slots per "
                         "rank; moving its blocks between engines is supported on one process only")
    return [shard.kv_heads for shard in split_heads(cfg.num_heads, cfg.num_kv_heads, world)]


def export_prefix(engine: LLMEngine, token_ids: list[int], salt: str | None) -> PrefixBlocks:
    """The blocks of token_ids' longest cached prefix (full blocks only), of every KV group."""
    kv = engine.kv
    hit, tables = kv.exportable_tables(kv.prefix_keys(token_ids, salt))
    groups = [[i for i, _ in table] for table in tables]
    index = torch.tensor([block for table in tables for _, block in table], dtype=torch.long)
    data = join_heads(engine.runner.read_blocks(index), kv_head_shards(engine))
    return PrefixBlocks(token_ids[: hit * kv.block_size], salt, kv.block_size, data, groups)


def import_prefix(engine: LLMEngine, prefix: PrefixBlocks) -> int:
    """Adopt the blocks this engine's cache lacks; the number adopted. ValueError where they do not fit its cache."""
    kv, shards = engine.kv, kv_head_shards(engine)
    if prefix.block_size != kv.block_size:
        raise ValueError(f"block_size: the blocks hold {prefix.block_size} tokens, this engine's {kv.block_size}")
    layout = ValueError("kv: the blocks' layout (layers, KV groups, KV heads, head size, cache dtype) is not this "
                        "engine's; prefill and decode must run the same model with the same dtype and kv_cache_dtype")
    rows = sum(len(g) for g in prefix.groups)
    if len(prefix.groups) != len(kv.layout.groups) or any(d.dim() < 2 or d.shape[0] != rows for d in prefix.data) or \
            any(i >= prefix.num_blocks for g in prefix.groups for i in g):
        raise layout
    if shards is not None and any(d.shape[1] != engine.loaded.config.num_kv_heads for d in prefix.data):
        raise layout  # (cut_heads would cut fewer heads than the ranks hold)
    parts = cut_heads(prefix.data, shards, engine.config.tensor_parallel_size)
    if not engine.runner.takes_blocks([[(tuple(d.shape), d.dtype) for d in rank] for rank in parts]):
        raise layout
    placed = kv.adopt(kv.prefix_keys(prefix.token_ids, prefix.salt), prefix.groups)
    if placed:
        rows = torch.tensor([i for i, _ in placed], dtype=torch.long)
        blocks = torch.tensor([b for _, b in placed], dtype=torch.long)
        engine.runner.write_blocks(blocks, [d.index_select(0, rows) for d in prefix.data], shards)
    return len(placed)
