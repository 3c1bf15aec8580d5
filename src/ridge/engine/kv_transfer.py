"""A cached prompt prefix's KV moved between two engines of the same model: disaggregated prefill and decode.

A prefill engine runs a prompt, then exports the full blocks of it that its prefix cache holds (their K and V
tensors, block by block, in its cache's own layout); a decode engine adopts them into its prefix cache, keyed by the
same chained hashes of the same tokens (kv/prefix_cache.py), so that the request it then receives finds the prompt
cached and computes only the tokens after the last full block, as any prefix-cache hit does. The tokens are the
colocated run's by construction: a block that did not arrive (evicted before the export, or no room to adopt it)
is computed again, never guessed.
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
    data: list[torch.Tensor]  # per cache tensor (AttentionBackend.block_tensors' order): [rows, ...one block]
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
    if config.tensor_parallel_size > 1 or config.device != "cpu":
        raise ValueError(f"role: {role} runs on one CPU process so far (tensor_parallel_size=1, device=cpu)")


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
    data = [t.index_select(dim, index).movedim(dim, 0).contiguous() for t, dim in engine.runner.backend.block_tensors()]
    return PrefixBlocks(token_ids[: hit * kv.block_size], salt, kv.block_size, data, groups)


def import_prefix(engine: LLMEngine, prefix: PrefixBlocks) -> int:
    """Adopt the blocks this engine's cache lacks; the number adopted. ValueError where they do not fit its cache."""
    kv, tensors = engine.kv, engine.runner.backend.block_tensors()
    if prefix.block_size != kv.block_size:
        raise ValueError(f"block_size: the blocks hold {prefix.block_size} tokens, this engine's {kv.block_size}")
    rows = sum(len(g) for g in prefix.groups)
    if len(prefix.data) != len(tensors) or len(prefix.groups) != len(kv.layout.groups) or any(
            d.shape[1:] != t.movedim(dim, 0).shape[1:] or d.dtype != t.dtype or d.shape[0] != rows
            for d, (t, dim) in zip(prefix.data, tensors, strict=False)) or any(
            i >= prefix.num_blocks for g in prefix.groups for i in g):
        raise ValueError("kv: the blocks' layout (layers, KV groups, KV heads, head size, cache dtype) is not this "
                         "engine's; prefill and decode must run the same model with the same dtype and kv_cache_dtype")
    placed = kv.adopt(kv.prefix_keys(prefix.token_ids, prefix.salt), prefix.groups)
    if placed:
        rows = torch.tensor([i for i, _ in placed], dtype=torch.long)
        blocks = torch.tensor([b for _, b in placed], dtype=torch.long)
        for data, (tensor, dim) in zip(prefix.data, tensors, strict=True):
            tensor.index_copy_(dim, blocks, data.index_select(0, rows).movedim(0, dim).to(tensor.device))
    return len(placed)
