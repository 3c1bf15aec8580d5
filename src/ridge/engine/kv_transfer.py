"""A cached prompt prefix's KV moved between two engines of the same model: disaggregated prefill and decode.

A prefill engine runs a prompt, then exports the full blocks of it that its prefix cache holds (their K and V
tensors, block by block, in its cache's own layout); a decode engine adopts them into its prefix cache, keyed by the
same chained hashes of the same tokens (kv/prefix_cache.py), so that the request it then receives finds the prompt
cached and computes only the tokens after the last full block, as any prefix-cache hit does. The tokens are the
colocated run's by construction: a block that did not arrive (evicted before the export, or no room to adopt it)
is computed again, never guessed.

Tensor-parallel engines move blocks rank to rank: each rank holds its own KV heads' part of every block, so an export
gathers every rank's part on rank 0 and an import hands rank r the exporter's rank r part. Both sides run the same
tensor_parallel_size (the parts are cut by it); a state-space model's snapshots do not travel (refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    # by tensor-parallel rank (one in one process), per cache tensor (AttentionBackend.read_blocks' form): [rows, ...]
    data: list[list[torch.Tensor]]
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
        return sum(t.nbytes for rank in self.data for t in rank)


def check_config(config: EngineConfig, role: str) -> None:
    """ValueError naming what keeps an engine of this config from moving cached prefixes (before it loads)."""
    if not config.enable_prefix_caching:
        raise ValueError(f"role: {role} moves prefix-cache blocks; enable_prefix_caching must be on")
    if config.device != "cpu":
        raise ValueError(f"role: {role} runs on the CPU so far (device=cpu)")


def check_transferable(engine: LLMEngine) -> None:
    """ValueError naming what keeps this engine from moving cached prefixes."""
    check_config(engine.config, "disaggregated prefill")
    if engine.kv.cache is None:
        raise ValueError("role: disaggregated prefill moves prefix-cache blocks, and this engine keeps no prefix "
                         "cache")
    if engine.loaded.config.ssm_layers:
        raise ValueError("role: disaggregated prefill moves KV blocks, not the snapshots of a state-space model's "
                         "recurrent state its prefixes resume from (kv/state_snapshots.py); serve it colocated")


def export_prefix(engine: LLMEngine, token_ids: list[int], salt: str | None) -> PrefixBlocks:
    """The blocks of token_ids' longest cached prefix (full blocks only), of every KV group."""
    kv = engine.kv
    hit, tables = kv.exportable_tables(kv.prefix_keys(token_ids, salt))
    groups = [[i for i, _ in table] for table in tables]
    index = torch.tensor([block for table in tables for _, block in table], dtype=torch.long)
    return PrefixBlocks(token_ids[: hit * kv.block_size], salt, kv.block_size, engine.runner.read_blocks(index), groups)


def import_prefix(engine: LLMEngine, prefix: PrefixBlocks) -> int:
    """Adopt the blocks this engine's cache lacks; the number adopted. ValueError where they do not fit its cache."""
    kv, ranks = engine.kv, engine.config.tensor_parallel_size
    if prefix.block_size != kv.block_size:
        raise ValueError(f"block_size: the blocks hold {prefix.block_size} tokens, this engine's {kv.block_size}")
    if len(prefix.data) != ranks:
        raise ValueError(f"tensor_parallel_size: the blocks come from {len(prefix.data)} rank(s), this engine runs "
                         f"{ranks}; prefill and decode must run the same tensor_parallel_size")
    rows = sum(len(g) for g in prefix.groups)
    shapes = [[(tuple(d.shape), d.dtype) for d in rank] for rank in prefix.data]
    if len(prefix.groups) != len(kv.layout.groups) or any(
            shape[0] != rows for rank in shapes for shape, _ in rank) or any(
            i >= prefix.num_blocks for g in prefix.groups for i in g) or not engine.runner.takes_blocks(shapes):
        raise ValueError("kv: the blocks' layout (layers, KV groups, KV heads, head size, cache dtype) is not this "
                         "engine's; prefill and decode must run the same model with the same dtype and kv_cache_dtype")
    placed = kv.adopt(kv.prefix_keys(prefix.token_ids, prefix.salt), prefix.groups)
    if placed:
        rows = torch.tensor([i for i, _ in placed], dtype=torch.long)
        blocks = torch.tensor([b for _, b in placed], dtype=torch.long)
        engine.runner.write_blocks(blocks, [[d.index_select(0, rows) for d in rank] for rank in prefix.data])
    return len(placed)
