"""The batched paged backend: all decodes of a step in one call, GQA without repeating K/V.

On the CPU, decodes run in a C++ kernel that reads K/V straight from their blocks
(kernels/paged_attention.cpp). Elsewhere (CUDA, or no compiler) they are gathered into a padded
batch for one SDPA call, with the query heads that share a K/V head folded into the query-length axis
([kv_heads, group * n, d]). Prefill chunks go through SDPA one sequence at a time with enable_gqa: a
chunk that is its sequence's whole context attends to this step's k, v directly under is_causal
(measured 2x faster on the CPU than an explicit mask); a chunk that continues a cached context (a
prefix-cache hit, or a long prompt's later chunk) gathers the cache under a mask built once per step in
prepare(), or, when short and in bf16 on the CPU, reads the blocks in place through the decode kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.attention.backend import AttentionBackend, AttentionMetadata

# A continuation chunk up to this many tokens reads its context in place through the decode kernel; a
# longer one gathers the context for masked SDPA, whose matmuls run ~2x the kernel's FLOP rate on chunks of
# 160-1,000 tokens (measured in bf16 on 1,000-token contexts; the two are even near 64).
IN_PLACE_MAX_CHUNK = 64


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
            if chunk.context_len == chunk.length:
                meta.prefill_masks.append(None)  # no cached prefix: plain causal attention
                continue
            width = chunk.block_table.shape[0] * self.block_size
            query_pos = torch.arange(chunk.context_len - chunk.length, chunk.context_len, device=device)
            causal = torch.arange(width, device=device)[None, :] <= query_pos[:, None]  # [n, L]
            meta.prefill_masks.append(causal)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        b = meta.num_decodes
        decoded = self._decode(layer, q[:b], meta) if b else None
        if not meta.prefills:
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:b] = decoded
        for chunk, mask in zip(meta.prefills, meta.prefill_masks, strict=True):
            rows = slice(chunk.start, chunk.start + chunk.length)
            if (mask is not None and self.ops is not None and q.dtype == torch.bfloat16
                    and chunk.length <= IN_PLACE_MAX_CHUNK):
                out[rows] = self._continue_in_place(layer, q[rows], chunk)
                continue
            if mask is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [H, n, d]
            else:
                keys, values = self.gather(layer, chunk.block_table)  # [H, L, d]
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True,
            )
            out[rows] = o[0].transpose(0, 1)
        return out

    def _continue_in_place(self, layer: int, q: torch.Tensor, chunk) -> torch.Tensor:
        """A chunk after a cached context, through the decode kernel: each query token is a row that reads
        the blocks in place up to its own position (its causal mask), with no gathered copy of the context.
        For short chunks in bf16 (the kernel's fast path): a decode step's few new tokens after a prefix hit."""
        n = chunk.length
        tables = chunk.block_table.unsqueeze(0).expand(n, -1)
        lens = torch.arange(chunk.context_len - n + 1, chunk.context_len + 1, device=q.device)
        return self.ops.paged_decode(q, self.k_cache[layer], self.v_cache[layer], tables, lens, self.scale)

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
