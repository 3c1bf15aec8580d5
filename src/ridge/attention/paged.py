"""The batched paged backend: all decodes of a step in one call, GQA by grouping.

On the CPU, decodes run in a C++ kernel that reads K/V rows straight from their blocks
(kernels/paged_attention.cpp). Elsewhere (CUDA, or no compiler) they are gathered into a padded
batch for one SDPA call. Query heads that share a K/V head are folded into the query-length axis
([kv_heads, group * n, d]), so K/V are never repeated per query head. Prefill chunks go through
SDPA one sequence at a time. Masks are built once per step in prepare() and shared by all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.attention.backend import AttentionBackend, AttentionMetadata


class PagedBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        if meta.num_decodes and self.ops is None:
            width = meta.decode_block_tables.shape[1] * self.block_size
            positions = torch.arange(width, device=device)
            # [1, B, 1, L]: broadcast over kv heads and the query group
            meta.decode_mask = (positions < meta.decode_context_lens.unsqueeze(1))[None, :, None, :]
        meta.prefill_masks = []
        for chunk in meta.prefills:
            width = chunk.block_table.shape[0] * self.block_size
            query_pos = torch.arange(chunk.context_len - chunk.length, chunk.context_len, device=device)
            causal = torch.arange(width, device=device)[None, :] <= query_pos[:, None]  # [n, L]
            meta.prefill_masks.append(causal)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        heads, d = q.shape[1], q.shape[2]
        group = heads // self.num_kv_heads
        b = meta.num_decodes
        decoded = self._decode(layer, q[:b], meta) if b else None
        if not meta.prefills:
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:b] = decoded
        for chunk, mask in zip(meta.prefills, meta.prefill_masks, strict=True):
            n = chunk.length
            k, v = self.gather(layer, chunk.block_table)  # [H, L, d]
            qp = q[chunk.start : chunk.start + n].view(n, self.num_kv_heads, group, d).permute(1, 2, 0, 3)
            qp = qp.reshape(1, self.num_kv_heads, group * n, d)  # 4-D: SDPA's fused CPU kernel wants it
            o = F.scaled_dot_product_attention(qp, k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=mask.repeat(group, 1), scale=self.scale)
            out[chunk.start : chunk.start + n] = o.view(self.num_kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(
                n, heads, d
            )
        return out

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [B, heads, d], one new token per sequence -> [B, heads, d]."""
        if self.ops is not None:
            return self.ops.paged_decode(q, self.k_cache[layer], self.v_cache[layer],
                                                   meta.decode_block_tables, meta.decode_context_lens, self.scale)
        b, heads, d = q.shape
        group = heads // self.num_kv_heads
        k, v = self.gather(layer, meta.decode_block_tables)  # [H, B, L, d]
        qd = q.view(b, self.num_kv_heads, group, d).transpose(0, 1)  # [H, B, G, d]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.transpose(0, 1).reshape(b, heads, d)
