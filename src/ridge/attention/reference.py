"""The reference backend: one sequence at a time, K/V repeated per query head, softmax in float32; the one
backend with attention logit soft-capping (Gemma 2).

Slow and plain on purpose: it is what the fast backends are checked against.
"""

from __future__ import annotations

import torch

from ridge.attention.backend import AttentionBackend, AttentionMetadata, sink_softmax, window_mask
from ridge.kv.layout import Window


class ReferenceBackend(AttentionBackend):
    handles_sinks = True

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reads everything back from the cache (this step's k, v included): that is what it checks."""
        out = torch.empty_like(q)
        for i in range(meta.num_decodes):
            ctx = int(meta.decode_context_lens[i])
            out[i : i + 1] = self._one(layer, q[i : i + 1], meta.decode_block_tables[i], ctx, meta.window, sinks)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = self._one(layer, q[rows], chunk.block_table, chunk.context_len, meta.window, sinks,
                                  meta.causal, chunk.last_keys)
        return out

    def _one(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, context_len: int,
             window: Window | None, sinks: torch.Tensor | None, causal: bool = True,
             last_keys: torch.Tensor | None = None) -> torch.Tensor:
        """q: [n, heads, d], the last n of context_len tokens -> [n, heads, d]; causal False: each sees them all;
        last_keys: each query's last visible key where it sees past itself (PrefillChunk)."""
        k, v = self.gather(layer, block_table)
        group = q.shape[1] // k.shape[0]
        k = k[:, :context_len].repeat_interleave(group, dim=0).float()  # [heads, ctx, d]
        v = v[:, :context_len].repeat_interleave(group, dim=0).float()
        n = q.shape[0]
        scores = torch.einsum("nhd,hcd->hnc", q.float(), k) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            visible = window_mask(torch.arange(context_len - n, context_len), torch.arange(context_len), window,
                                  last_keys)
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        weights = scores.softmax(-1) if sinks is None else sink_softmax(scores, sinks)
        return torch.einsum("hnc,hcd->nhd", weights, v).to(q.dtype)
