"""Multi-head latent attention's cache and attention (models/mla.py): one row per token, read as keys and values.

A layer's cache is [num_blocks, block_size, dim]: each token's latent (value_dim = kv_lora_rank values) followed
by its rotary key. Every query head scores the whole row and takes the weighted sum of its latent part, so one
KV head of `dim` values a token is all the cache holds (DeepSeek-V3: 576, where K and V per head would hold
32,768). Attention runs in torch, decodes batched over a padded gather of their blocks, prefill chunks one by
one; softmax in float32.
"""

from __future__ import annotations

import torch

from ridge.attention.backend import AttentionBackend, AttentionMetadata, window_mask


class LatentBackend(AttentionBackend):
    def __init__(self, *args, value_dim: int, **kwargs) -> None:
        """value_dim: the leading values of a row that attention sums (the latent); the rest only score."""
        super().__init__(*args, **kwargs)
        self.value_dim = value_dim

    def cache_shapes(self, num_kv_heads: int, num_blocks: int, head_dim: int,
                     block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if num_kv_heads != 1:
            raise ValueError(f"latent attention caches one row per token, not {num_kv_heads} KV heads")
        return (num_blocks, block_size, head_dim), (0,)  # no separate values: they are the rows' latents

    def block_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return [(t, 0) for t in {id(t): t for t in self.k_cache.values()}.values()]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k: [T, 1, dim], the tokens' rows (v is the same rows)."""
        self.k_cache[layer].view(-1, self.head_dim)[slots] = k[:, 0]

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block ids [..., n] -> rows [..., n * block_size, dim] (as keys) and their latents (as values)."""
        rows = self.k_cache[layer][block_table].flatten(-3, -2)
        return rows, rows[..., :self.value_dim]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, dim] -> [T, heads, value_dim]."""
        out = q.new_empty(q.shape[0], q.shape[1], self.value_dim)
        decodes = meta.num_decodes
        if decodes:
            rows, latents = self.gather(layer, meta.decode_block_tables)  # [B, L, dim], [B, L, value_dim]
            scores = torch.einsum("bhd,bld->bhl", q[:decodes].float(), rows.float()) * self.scale
            positions = torch.arange(rows.shape[1], device=q.device)
            lens = meta.decode_context_lens.unsqueeze(1)
            visible = positions < lens
            if meta.window is not None:
                visible &= positions >= lens - meta.window
            scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
            out[:decodes] = torch.einsum("bhl,blv->bhv", scores.softmax(-1), latents.float()).to(q.dtype)
        for chunk in meta.prefills:
            n, context = chunk.length, chunk.context_len
            rows, latents = self.gather(layer, chunk.block_table)
            rows, latents = rows[:context].float(), latents[:context].float()
            scores = torch.einsum("nhd,cd->hnc", q[chunk.start:chunk.start + n].float(), rows) * self.scale
            visible = window_mask(torch.arange(context - n, context), torch.arange(context), meta.window)
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            out[chunk.start:chunk.start + n] = torch.einsum("hnc,cv->nhv", scores.softmax(-1), latents).to(q.dtype)
        return out
