"""Multi-head latent attention's cache and attention (models/mla.py): one row per token, read as keys and values.

A layer's cache is [num_blocks, block_size, dim]: each token's latent (value_dim = kv_lora_rank values) followed
by its rotary key. Every query head scores the whole row and takes the weighted sum of its latent part, so one
KV head of `dim` values a token is all the cache holds (DeepSeek-V3: 576, where K and V per head would hold
32,768). On the CPU, decodes read their rows in place in a C++ kernel (kernels/latent_attention.cpp), which the
fused decode step calls too (kernels/decode_stack.cpp), and on CUDA in a Triton kernel
(triton_kernels/latent_attention.py); elsewhere they are gathered into a padded batch for torch. Prefill chunks run
in torch one by one; softmax in float32. A chunk of EXPAND_MIN_TOKENS or more attends in the expanded form instead
(attend_expanded): its context's latents multiplied out to K and V per head, then SDPA.

With heavy-hitter eviction the backend reports each sequence's attention mass per block, as the paged backend
does: the kernel sums it for decodes, torch for a chunk's observed rows.

With sparse attention (models/sparse_index.py) each layer also caches an indexer key per token, in a tensor of its
own beside the rows ([num_blocks, block_size, index_dim], the same block ids), and a step's queries may come with a
KeySelection: a decode then gathers the rows of its chosen positions only and attends in torch, a chunk attends
under its mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import ModuleType

import torch
import torch.nn.functional as F

from ridge.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KernelRows,
    PrefillChunk,
    StepMetadata,
    window_mask,
)
from ridge.kv.eviction import OBSERVED_ROWS
from ridge.kv.layout import Window

# The absorbed form scores each of a chunk's n queries against a context token's whole row (2 * rank + rope
# multiply-adds a head, scores and sums); the expanded form first multiplies every context token's latent out to
# K and V per head (rank * (nope + v_dim) a head), then attends in nope + rope + v_dim. At DeepSeek's shapes (rank
# 512, nope 128, rope 64, v_dim 128) expanding costs fewer operations from n of ~170 on, and SDPA's fused kernel
# never holds the n x context scores; below it, as for a decode or a speculative step's few drafts over a long
# context, expanding the whole context would cost more than the attention.
EXPAND_MIN_TOKENS = 128


@dataclass
class KeySelection:
    """The keys sparse attention's indexer chose for a step's queries, beside the causal rule: for the decodes,
    positions in each one's context [B, k] (those not valid: a context shorter than k); for a prompt chunk (by its
    start row), a mask [length, context_len]. Decodes or a chunk left out read their whole context (it is no
    longer than k)."""

    decode_keys: torch.Tensor | None = None
    decode_valid: torch.Tensor | None = None
    chunk_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class LatentBackend(AttentionBackend):
    def __init__(self, *args, value_dim: int, index_dim: int = 0, **kwargs) -> None:
        """value_dim: the leading values of a row that attention sums (the latent); the rest only score. index_dim:
        the width of a sparse-attention indexer's key, cached per token and layer (0: none)."""
        super().__init__(*args, **kwargs)
        self.value_dim = value_dim
        self.index_keys = (self._per_layer(self.layout, (self.num_blocks, self.block_size, index_dim), self.dtype,
                                           self.device) if index_dim else {})

    def cache_shapes(self, num_kv_heads: int, num_blocks: int, head_dim: int,
                     block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if num_kv_heads != 1:
            raise ValueError(f"latent attention caches one row per token, not {num_kv_heads} KV heads")
        return (num_blocks, block_size, head_dim), (0,)  # no separate values: they are the rows' latents

    def block_tensors(self) -> list[tuple[torch.Tensor, int]]:
        tensors = [*self.k_cache.values(), *self.index_keys.values()]
        return [(t, 0) for t in {id(t): t for t in tensors}.values()]

    @cached_property
    def triton(self) -> ModuleType | None:
        """Triton's decode kernel on CUDA (Triton comes with CUDA torch); None elsewhere."""
        if self.device.type != "cuda":
            return None
        from ridge.triton_kernels import latent_attention

        return latent_attention

    @cached_property
    def multiprocessors(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    @property
    def kernel(self) -> bool:
        """Whether decodes run in the C++ kernel (the CPU, a float32 or bfloat16 cache)."""
        return self.ops is not None and self.dtype in (torch.float32, torch.bfloat16)

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.kernel and meta.num_decodes:  # the decodes' own tables, as the kernel and the fused step read them
            lens = meta.decode_context_lens
            meta.kernel_rows = KernelRows(None, meta.decode_block_tables, lens, window_starts=meta.window_starts(lens))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k: [T, 1, dim], the tokens' rows (v is the same rows); on CUDA a negative slot (a CUDA graph's padding
        row) is written nowhere."""
        if self.triton is not None:
            self.triton.write_rows(k[:, 0], self.k_cache[layer], slots)
            return
        self.k_cache[layer].view(-1, self.head_dim).index_copy_(0, slots, k[:, 0])

    def write_index_keys(self, layer: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """keys [T, index_dim] -> the indexer's cache at the tokens' slots (negative slots, as write's, nowhere)."""
        if self.triton is not None:
            self.triton.write_rows(keys, self.index_keys[layer], slots)
            return
        self.index_keys[layer].view(-1, keys.shape[-1]).index_copy_(0, slots, keys)

    def gather_index_keys(self, layer: int, block_table: torch.Tensor) -> torch.Tensor:
        """block ids [..., n] -> the indexer's keys [..., n * block_size, index_dim]."""
        return self.index_keys[layer][block_table].flatten(-3, -2)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block ids [..., n] -> rows [..., n * block_size, dim] (as keys) and their latents (as values)."""
        rows = self.k_cache[layer][block_table].flatten(-3, -2)
        return rows, rows[..., :self.value_dim]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMetadata,
                sinks: torch.Tensor | None = None, selection: KeySelection | None = None) -> torch.Tensor:
        """As AttentionBackend.forward, the queries restricted to a sparse-attention selection where one is given."""
        meta = step[self.group_of_layer[layer]]
        self.write(layer, k, v, meta.slot_mapping)
        return self.attend(layer, q, k, v, meta, selection)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, selection: KeySelection | None = None) -> torch.Tensor:
        """q: [T, heads, dim] -> [T, heads, value_dim]."""
        decodes, mass = meta.num_decodes, meta.attention_mass
        if decodes and selection is not None and selection.decode_keys is not None:
            decoded = self.decode_selected(layer, q[:decodes], meta, selection)
        else:
            decoded = self.decode(layer, q[:decodes], meta) if decodes else None
        if not meta.prefills:
            return decoded
        out = q.new_empty(q.shape[0], q.shape[1], self.value_dim)
        if decoded is not None:
            out[:decodes] = decoded
        for i, chunk in enumerate(meta.prefills):
            n, context = chunk.length, chunk.context_len
            rows, latents = self.gather(layer, chunk.block_table)
            rows, latents = rows[:context].float(), latents[:context].float()
            scores = torch.einsum("nhd,cd->hnc", q[chunk.start:chunk.start + n].float(), rows) * self.scale
            chosen = selection.chunk_masks.get(chunk.start) if selection is not None else None
            visible = chosen if chosen is not None else window_mask(  # (a choice is within the causal rule)
                torch.arange(context - n, context), torch.arange(context), meta.window).to(scores.device)
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[chunk.start:chunk.start + n] = torch.einsum("hnc,cv->nhv", probs, latents).to(q.dtype)
            if mass is not None:  # a chunk's last OBSERVED_ROWS queries (kv/eviction.py)
                self._add_mass(mass[decodes + i:decodes + i + 1], probs[:, -OBSERVED_ROWS:].sum((0, 1))[None])
        return out

    def decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's decodes, one query per row [B, heads, dim] -> [B, heads, value_dim], over the rows of its
        table: read in place by the C++ kernel on the CPU and by Triton's on CUDA, else gathered into a padded
        batch for torch."""
        mass = None if meta.attention_mass is None else meta.attention_mass[:q.shape[0]]
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if meta.kernel_rows is not None:
            kernel = meta.kernel_rows
            return self.ops.latent_decode(q, self.k_cache[layer], kernel.block_tables, kernel.context_lens,
                                          self.scale, self.value_dim, kernel.window_starts, mass)[..., :self.value_dim]
        if self.triton is not None and mass is None:  # (heavy-hitter eviction runs on the CPU only)
            splits = self.triton.num_splits(q.shape[0], q.shape[1], tables.shape[1] * self.block_size,
                                            self.multiprocessors)
            return self.triton.latent_decode(q, self.k_cache[layer], tables, lens, self.scale, self.value_dim,
                                             meta.window_starts(lens), splits)
        rows, latents = self.gather(layer, tables)  # [B, L, dim], [B, L, value_dim]
        scores = torch.einsum("bhd,bld->bhl", q.float(), rows.float()) * self.scale
        positions = torch.arange(rows.shape[1], device=q.device)
        visible = positions < lens.unsqueeze(1)
        if meta.window is not None:
            visible &= positions >= meta.window_starts(lens).unsqueeze(1)
        probs = scores.masked_fill(~visible.unsqueeze(1), float("-inf")).softmax(-1)
        if mass is not None:
            self._add_mass(mass, probs.sum(1))
        return torch.einsum("bhl,blv->bhv", probs, latents.float()).to(q.dtype)

    def decode_selected(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                        selection: KeySelection) -> torch.Tensor:
        """The step's decodes [B, heads, dim] over the rows of their selected positions only, gathered through
        their tables -> [B, heads, value_dim]."""
        positions, tables = selection.decode_keys, meta.decode_block_tables
        slots = tables.gather(1, positions // self.block_size) * self.block_size + positions % self.block_size
        rows = self.k_cache[layer].view(-1, self.head_dim)[slots].float()  # [B, k, dim]
        scores = torch.einsum("bhd,bkd->bhk", q.float(), rows) * self.scale
        probs = scores.masked_fill(~selection.decode_valid.unsqueeze(1), float("-inf")).softmax(-1)
        return torch.einsum("bhk,bkv->bhv", probs, rows[..., :self.value_dim]).to(q.dtype)

    def attend_expanded(self, layer: int, chunk: PrefillChunk, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, window: Window | None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk in the expanded form (its rows already written): q_nope [n, heads, nope], q_pe [n, heads,
        rope] (rotated); w_uk [heads, nope, rank], w_uv [heads, v_dim, rank] -> [n, heads, v_dim]; selected: the
        chunk's sparse-attention mask [n, context_len], within the causal rule (None: all it may see). Reports no
        attention mass: with heavy-hitter eviction chunks stay absorbed (models/mla.py)."""
        n, context = chunk.length, chunk.context_len
        rows = self.gather(layer, chunk.block_table)[0][:context]  # [C, rank + rope]
        latents, k_pe = rows[:, :self.value_dim], rows[:, self.value_dim:]
        heads = q_nope.shape[1]
        keys = torch.cat([torch.einsum("cr,hnr->hcn", latents, w_uk), k_pe.expand(heads, -1, -1)], dim=-1)
        values = torch.einsum("cr,hvr->hcv", latents, w_uv)  # [heads, C, v_dim]
        queries = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [heads, n, nope + rope]
        if selected is not None:
            causal, mask = False, selected
        else:  # a whole prompt without a window: SDPA's causal flag is the mask
            causal = context == n and (window is None or window.first_key(context - 1) == 0)
            mask = None if causal else window_mask(torch.arange(context - n, context, device=rows.device),
                                                   torch.arange(context, device=rows.device), window)
        out = F.scaled_dot_product_attention(queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, is_causal=causal, scale=self.scale)[0]
        return out.transpose(0, 1)

    def _add_mass(self, mass: torch.Tensor, per_key: torch.Tensor) -> None:
        """mass [R, width] += per_key [R, L] (probabilities summed over heads and queries) summed per block."""
        blocks = F.pad(per_key, (0, -per_key.shape[-1] % self.block_size)).unflatten(-1, (-1, self.block_size)).sum(-1)
        mass[:, :blocks.shape[1]] += blocks
