"""Multi-head latent attention (DeepSeek-V3, Kimi K2): the cache holds one latent per token, not K and V per head.

A token's keys and values come from a shared latent c = norm(W_DKV x) of kv_lora_rank values and a rotary key
k_pe of qk_rope_head_dim values that every head shares; head h's key is [W_UK[h] c, k_pe] and its value
W_UV[h] c. Attention runs in the absorbed form (DeepSeek-V2's paper, section 2.1.3): W_UK[h] is folded into head
h's query, q_h' = [W_UK[h]^T q_nope_h, q_pe_h], so that every head scores the cached [c, k_pe] rows directly
(one KV head of kv_lora_rank + qk_rope_head_dim dims, attention/latent.py), and W_UV[h] is applied to each
head's weighted sum of c after. Decode then reads the latents only, 576 values a token a layer for DeepSeek-V3.
A prompt chunk of attention/latent.py's EXPAND_MIN_TOKENS or more attends in the expanded form instead, K and V per
head multiplied out of its context's latents: fewer operations for long chunks, as vLLM and SGLang prefill. On the
CPU the per-head products run in C++ (kernels/latent_attention.cpp's head_matmul): torch's bmm copied
kv_b's non-contiguous slices on every call.

With sparse attention (DeepSeek-V3.2, GLM-5) an indexer (models/sparse_index.py) first chooses the keys each query
reads, and the backend attends over those only.

DeepSeek's checkpoints lay the rotary dimensions out in interleaved pairs; the loader reorders those rows of
the q and kv_a projections to halves (models/loader.py), so that the shared rotary code applies.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
from torch import nn

from ridge.attention.backend import AttentionBackend, StepMetadata
from ridge.attention.latent import EXPAND_MIN_TOKENS, LatentBackend
from ridge.config import ModelConfig
from ridge.models.layers import RMSNorm, RopeStep
from ridge.models.sparse_index import Indexer


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.rank = cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_width = cfg.num_heads * (self.nope + self.rope)
        if cfg.q_lora_rank:  # the query through its own low-rank bottleneck (DeepSeek-V3)
            self.q_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=False)
        self.kv_a = nn.Linear(cfg.hidden_size, self.rank + self.rope, bias=False)  # W_DKV and the rotary key
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # W_UK and W_UV of every head, [heads * (nope + v_dim), rank]: a parameter, not a layer, since decode only
        # ever multiplies by its per-head slices (never by the whole matrix)
        self.kv_b = nn.Parameter(torch.empty(cfg.num_heads * (self.nope + self.v_dim), self.rank))
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=False)
        # sparse attention (DeepSeek-V3.2, GLM-5): which keys each query reads
        self.indexer = Indexer(cfg, layer_index) if cfg.index_topk else None
        self.ops: ModuleType | None = None  # fused kernels, set by DecoderModel.use_kernels (CUDA's have no per-head
        # product: there torch's einsum is one batched cuBLAS call)

    def _per_head(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
        """x [T, heads, in] -> x[:, h] @ weight[h] (transposed: weight[h].T) for every head."""
        if self.ops is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return self.ops.head_matmul(x, weight, transposed)
        return torch.einsum("thi,hoi->tho" if transposed else "thi,hio->tho", x, weight)

    def forward(self, x: torch.Tensor, rope: RopeStep, backend: AttentionBackend, meta: StepMetadata) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        q_latent = self.q_a_norm(self.q_a(x)) if hasattr(self, "q_a") else None
        q = self.q_b(q_latent) if q_latent is not None else self.q_proj(x)
        rope.temper_(q)  # before the rotary: both are linear in q, so they commute
        q_nope, q_pe = q.view(tokens, heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous().view(tokens, 1, self.rope)
        rope.apply_(q_pe, heads)
        rope.apply_(k_pe, 1)
        up = self.kv_b.view(heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = up[:, :self.nope], up[:, self.nope:]
        row = torch.cat([self.kv_a_norm(latent), k_pe.view(tokens, self.rope)], dim=-1).unsqueeze(1)
        group = meta[backend.group_of_layer[self.layer_index]]
        selection = self.indexer(x, q_latent, rope, backend, group) if self.indexer is not None else None
        # long chunks expanded (with heavy-hitter eviction every chunk stays absorbed: the backend sums their mass)
        long = ([c for c in group.prefills if c.length >= EXPAND_MIN_TOKENS]
                if isinstance(backend, LatentBackend) and group.attention_mass is None else [])
        if not long:
            query = torch.cat([self._per_head(q_nope, w_uk, False), q_pe], dim=-1)
            sparse = {} if selection is None else {"selection": selection}
            mixed = backend.forward(self.layer_index, query, row, row, meta, **sparse)  # [T, heads, rank]: weighted
            # latents
            out = self._per_head(mixed, w_uv, True)
            return self.o_proj(out.reshape(tokens, heads * self.v_dim))
        backend.write(self.layer_index, row, row, group.slot_mapping)
        out = x.new_empty(tokens, heads, self.v_dim)
        short = dataclasses.replace(group, prefills=[c for c in group.prefills if c.length < EXPAND_MIN_TOKENS])
        absorbed = torch.cat([torch.arange(group.num_decodes, device=x.device)] + [
            torch.arange(c.start, c.start + c.length, device=x.device) for c in short.prefills])
        if len(absorbed):  # the step's decodes and short chunks, at their rows of a query the backend reads there
            query = q.new_zeros(tokens, heads, self.rank + self.rope)
            query[absorbed] = torch.cat([self._per_head(q_nope[absorbed], w_uk, False), q_pe[absorbed]], dim=-1)
            mixed = backend.attend(self.layer_index, query, row, row, short, selection)
            out[absorbed] = self._per_head(mixed[absorbed].contiguous(), w_uv, True)
        masks = selection.chunk_masks if selection is not None else {}
        for chunk in long:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = backend.attend_expanded(self.layer_index, chunk, q_nope[rows], q_pe[rows], w_uk, w_uv,
                                                group.window, masks.get(chunk.start))
        return self.o_proj(out.reshape(tokens, heads * self.v_dim))
