"""The batched paged backend: every decode of a step in one SDPA call, GQA by grouping.

Query heads that share a K/V head are folded into the query-length axis ([kv_heads, group * n, d]),
so K/V are read once per KV head and never repeated. Runs on CPU and CUDA alike (SDPA picks the
kernel). Masks are built once per step in prepare() and shared by all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.attention.backend import AttentionBackend, AttentionMetadata


class PagedBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        if meta.num_decodes:
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
        out = torch.empty_like(q)
        if meta.num_decodes:
            b = meta.num_decodes
            k, v = self.gather(layer, meta.decode_block_tables)  # [H, B, L, d]
            qd = q[:b].view(b, self.num_kv_heads, group, d).transpose(0, 1)  # [H, B, G, d]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=self.scale)
            out[:b] = o.transpose(0, 1).reshape(b, heads, d)
        for chunk, mask in zip(meta.prefills, meta.prefill_masks, strict=True):
            n = chunk.length
            k, v = self.gather(layer, chunk.block_table)  # [H, L, d]
            qp = q[chunk.start : chunk.start + n].view(n, self.num_kv_heads, group, d).permute(1, 2, 0, 3)
            qp = qp.reshape(self.num_kv_heads, group * n, d)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask.repeat(group, 1), scale=self.scale)
            out[chunk.start : chunk.start + n] = o.view(self.num_kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(
                n, heads, d
            )
        return out
