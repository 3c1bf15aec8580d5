"""The attention mass of KV blocks, in torch: what heavy-hitter eviction ranks a sequence's blocks by
(kv/eviction.py), for the queries no kernel sums it for as it attends (a prompt chunk's observed rows, decodes
without ridge's CPU kernels). The decode kernels' own sum is the same quantity (kernels/decode_tasks.h)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_mass(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
               block_size: int) -> torch.Tensor:
    """q [..., m, heads, d] queries; keys [kv_heads, ..., L, d] (the same leading dims, e.g. a batch);
    visible [..., m, L] which keys each query sees -> [..., ceil(L / block_size)]: the queries' softmax
    probabilities over the keys, summed over the queries, their heads and the tokens of each block."""
    *lead, m, heads, d = q.shape
    kv_heads, length = keys.shape[0], keys.shape[-2]
    group = heads // kv_heads
    # [kv_heads, ..., m * group, d], row i * group + g: query i's head g of the kv head (GQA's grouping)
    grouped = q.float().unflatten(-2, (kv_heads, group)).movedim(-3, 0).flatten(-3, -2)
    scores = (grouped @ keys.float().transpose(-2, -1)) * scale
    scores.masked_fill_(~visible.repeat_interleave(group, dim=-2), float("-inf"))
    per_key = scores.softmax(-1).sum(dim=(0, -2))  # [..., L]
    padded = F.pad(per_key, (0, -length % block_size))
    return padded.unflatten(-1, (-1, block_size)).sum(-1)
