"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): an indexer picks the keys each query's latent attention
reads.

Beside MLA's latent row, each token caches an indexer key k(t) of index_head_dim values (a projection of the layer's
input, LayerNormed, its first qk_rope_head_dim dims turned by the model's rotary). A query scores every key of its
context with index_heads light heads, I(t) = sum_h w_h relu(q_h . k(t)) / sqrt(index_head_dim * index_heads), its
per-head weights w a projection of the same input, and attends to the index_topk keys of highest score only (to all
of them while its context is no longer). A decode then reads every context token's indexer key and index_topk
latent rows: at DeepSeek-V3.2's shapes and 128k tokens of context, 137 values a token a layer where dense latent
attention reads 576 (the selection: attention/latent.py's KeySelection).

The scores are summed head by head in float32: one [queries, context] product at a time, never the [queries,
heads, context] tensor (a 2k-token prompt chunk over an 8k context would hold 4 GiB of it at DeepSeek's 64 heads).
"""

from __future__ import annotations

import torch
from torch import nn

from ridge.attention.backend import AttentionMetadata, window_mask
from ridge.attention.latent import KeySelection, LatentBackend
from ridge.config import ModelConfig
from ridge.models.layers import RopeStep


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.dim, self.topk = cfg.index_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)  # from the query's bottleneck
        self.wk = nn.Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: RopeStep, backend: LatentBackend,
                meta: AttentionMetadata) -> KeySelection:
        """x: the layer's normed input [T, hidden]; q_latent: the query's normed bottleneck [T, q_lora_rank]. Writes
        the tokens' indexer keys to the cache, then chooses each query's keys."""
        tokens = x.shape[0]
        k = self.k_norm(self.wk(x)).view(tokens, 1, self.dim)
        rope.apply_(k, 1)  # its first qk_rope_head_dim dims (a partial rotary)
        backend.write_index_keys(self.layer_index, k[:, 0], meta.slot_mapping)
        selection = KeySelection()
        decodes, tables = meta.num_decodes, meta.decode_block_tables
        decodes_choose = decodes > 0 and tables.shape[1] * backend.block_size > self.topk  # else all are read
        choosing_chunks = [chunk for chunk in meta.prefills if chunk.context_len > self.topk]
        if not decodes_choose and not choosing_chunks:  # no query has more keys than the top k: nothing to score
            return selection
        q = self.wq_b(q_latent).view(tokens, self.heads, self.dim)
        rope.apply_(q, self.heads)
        weights = self.weights_proj(x).float() * (self.heads * self.dim) ** -0.5
        if decodes_choose:
            keys = backend.gather_index_keys(self.layer_index, tables)  # [B, L, dim]
            scores = _scores(q[:decodes], weights[:decodes], keys)  # [B, L]
            positions = torch.arange(keys.shape[1], device=x.device)
            scores.masked_fill_(positions >= meta.decode_context_lens.unsqueeze(1), float("-inf"))
            best = scores.topk(self.topk, dim=-1)
            selection.decode_keys, selection.decode_valid = best.indices, best.values > float("-inf")
        for chunk in choosing_chunks:
            rows = slice(chunk.start, chunk.start + chunk.length)
            keys = backend.gather_index_keys(self.layer_index, chunk.block_table)[:chunk.context_len]  # [C, dim]
            scores = _scores(q[rows], weights[rows], keys)  # [n, C]
            causal = window_mask(torch.arange(chunk.context_len - chunk.length, chunk.context_len, device=x.device),
                                 torch.arange(chunk.context_len, device=x.device), None)
            best = scores.masked_fill(~causal, float("-inf")).topk(self.topk, dim=-1).indices
            # a query with fewer causal keys than topk also drew later ones: the causal mask takes them back out
            selection.chunk_masks[chunk.start] = torch.zeros_like(causal).scatter_(1, best, True) & causal
        return selection


def _scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, heads, dim], weights [n, heads] (float32), keys [L, dim] (one context for all n queries) or [n, L, dim]
    (each query's own) -> I [n, L] = sum_h weights[:, h] * relu(q[:, h] . keys), in float32."""
    keys = keys.float()
    total = torch.zeros(q.shape[0], keys.shape[-2], dtype=torch.float32, device=keys.device)
    for h in range(q.shape[1]):
        query = q[:, h].float()
        product = query @ keys.T if keys.dim() == 2 else torch.bmm(keys, query.unsqueeze(-1)).squeeze(-1)
        total.addcmul_(weights[:, h:h + 1], product.relu_())
    return total
