"""Cascade attention: rows that share a cached prefix attend to it once, together.

When many sequences hold the same prefix blocks (a prefix-cache hit, n > 1 samples, beams, the tokens
of one continuation chunk), the decode kernel still scores every row against every prefix key with
vector FMAs, row by row. Split each row's attention in two: the shared prefix, as one dense batch of
queries against one copy of its K/V (a matmul-shaped problem that torch's CPU flash attention runs on
the matrix units, ~4x the kernel's FLOP rate in bf16), and each row's own suffix through the kernel.
Softmax over the union of the keys is the two partial results weighted by their denominators, which is
why both sides return the log-sum-exp of their scores; the C++ merge_attention_ combines them in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A shared prefix goes through the cascade only when it saves more than the extra calls cost: at least
# this many rows over at least this many tokens (the crossover: docs/notes/kernel-choices.md).
MIN_SHARED_ROWS = 8
MIN_SHARED_TOKENS = 256


@dataclass
class SharedPrefix:
    """Kernel rows whose block tables start with the same blocks."""

    rows: torch.Tensor  # [R] indices into the kernel rows
    block_ids: torch.Tensor  # [n] the blocks they share, every one full


def split_shared_prefixes(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
    min_rows: int = MIN_SHARED_ROWS, min_tokens: int = MIN_SHARED_TOKENS,
) -> tuple[list[SharedPrefix], torch.Tensor, torch.Tensor]:
    """Groups rows by their first block and takes each group's longest common run of blocks as its shared
    prefix (a group that diverges early keeps only the common part). Returns the prefixes and the suffix
    tables and lengths the kernel reads instead: each grouped row's table shifted past its prefix.

    A row's last token never falls in its prefix, so every suffix holds at least one key; that keeps both
    halves of a row's softmax non-empty."""
    prefixes: list[SharedPrefix] = []
    if block_tables.shape[0] < min_rows:  # no group can be large enough (a step's torch.unique costs ~25 us)
        return prefixes, block_tables, context_lens
    _, group_of, counts = torch.unique(block_tables[:, 0], return_inverse=True, return_counts=True)
    tables, lens = block_tables, context_lens
    for group in (counts >= min_rows).nonzero().flatten().tolist():
        rows = (group_of == group).nonzero().flatten()
        held = int((context_lens[rows].min() - 1) // block_size)  # full blocks before every row's last token
        candidate = block_tables[rows, :held]
        same = (candidate == candidate[0]).all(0).int()
        shared = int(same.cumprod(0).sum())
        if shared * block_size < min_tokens:
            continue
        if tables is block_tables:  # copy on the first group only
            tables, lens = block_tables.clone(), context_lens.clone()
        tables[rows] = torch.nn.functional.pad(block_tables[rows, shared:], (0, shared))
        lens[rows] -= shared * block_size
        prefixes.append(SharedPrefix(rows, block_tables[rows[0], :shared].clone()))
    return prefixes, tables, lens


def shared_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [R, heads, d] against every key of k, v: [kv_heads, P, d]. The query heads that share a K/V head
    fold into the query-length axis, one attention per K/V head; results stay folded:
    (out [kv_heads, R * group, d], lse [kv_heads, R * group]), row r's head h at [h // group, r * group +
    h % group] (the layout the C++ merge reads)."""
    rows, heads, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    folded = q.view(rows, kv_heads, group, d).transpose(0, 1).reshape(1, kv_heads, rows * group, d)
    out, lse = _flash_with_lse(folded, k.unsqueeze(0), v.unsqueeze(0), scale)
    return out[0], lse[0]


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, n, d] x [1, H, P, d]: torch's CPU flash attention, the one op that returns the log-sum-exp
    (an underscored aten op: torch's public SDPA drops it); plain math where it is missing."""
    if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        return out, lse
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v.float()).to(q.dtype), lse
