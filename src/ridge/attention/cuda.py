"""The CUDA backend: decodes through a Triton flash-decoding kernel over the paged cache; a fresh prompt through
SDPA (torch's flash kernel); chunks that continue a cached context (prefix-cache hits, a long prompt's later
chunks) through a Triton prefill kernel that reads that context in place from its blocks, all in one launch.

Its cache layout is [num_blocks, block_size, kv_heads, head_dim] per K and V (triton_kernels/paged_attention.py):
a token's row per write, whole 128-byte lines per read. Everything a decode step does here is a fixed
sequence of kernels on device tensors, with nothing read back to the host, so that a CUDA graph can
capture it (engine/cuda_graphs.py).

A quantized cache (`--kv-cache-dtype fp8|int8|int4`) keeps QuantizedKVBackend's storage and write (its rows
layout, written in torch) and is read by the same Triton kernels, which widen its codes as they read them:
CudaQuantizedKVBackend. Its write finds the blocks a step touches with host synchronisations, so its decode runs
eagerly, without CUDA graphs (the runner says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ridge.attention.backend import AttentionMetadata, PrefillChunk, StepMetadata
from ridge.attention.paged import PagedBackend
from ridge.attention.quantized_kv import BlockWrites, QuantizedKVBackend

if TYPE_CHECKING:
    from ridge.triton_kernels.paged_attention import QuantizedLayer


@dataclass
class ContextPrefill:
    """A step's prefill chunks that continue a cached context (prefix-cache hits, a long prompt's later chunks),
    as the Triton prefill kernel reads them: one launch per layer for all of them."""

    tables: torch.Tensor  # [C, W] block ids, padded with block 0
    starts: torch.Tensor  # [C] each chunk's first row in the step
    lengths: torch.Tensor  # [C]
    context_lens: torch.Tensor  # [C]
    tile_chunks: torch.Tensor  # [programs]: the chunk of each program's queries
    tile_offsets: torch.Tensor  # [programs]: its first query in the chunk

    @classmethod
    def of(cls, chunks: list[PrefillChunk], kernels: ModuleType) -> ContextPrefill:
        device = chunks[0].block_table.device
        width = max(chunk.block_table.shape[0] for chunk in chunks)
        tables = torch.stack([F.pad(chunk.block_table, (0, width - chunk.block_table.shape[0])) for chunk in chunks])
        tile_chunks, tile_offsets = kernels.prefill_tiles([chunk.length for chunk in chunks])

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(tables, longs([c.start for c in chunks]), longs([c.length for c in chunks]),
                   longs([c.context_len for c in chunks]), longs(tile_chunks), longs(tile_offsets))


class CudaBackend(PagedBackend):
    cascade = False
    block_dim = 0

    def cache_shapes(self, num_kv_heads: int, num_blocks: int, head_dim: int,
                     block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    @cached_property
    def triton(self) -> ModuleType:
        from ridge.triton_kernels import paged_attention  # Triton comes with CUDA torch; only on this path

        return paged_attention

    @cached_property
    def multiprocessors(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.triton.cache_write(k, v, self.k_cache[layer], self.v_cache[layer], slots)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k_cache[layer][block_table], self.v_cache[layer][block_table]  # [..., n, bs, H, d]
        shape = (*k.shape[:-4], k.shape[-4] * self.block_size, *k.shape[-2:])
        return k.reshape(shape).movedim(-2, 0), v.reshape(shape).movedim(-2, 0)  # [H, ..., n * bs, d]

    def prepare(self, meta: AttentionMetadata) -> None:
        # (the context kernel reads each row's own prefix: a chunk whose queries see past themselves goes to SDPA)
        fresh = [chunk for chunk in meta.prefills if chunk.context_len == chunk.length or chunk.last_keys is not None]
        meta.sdpa_chunks = [self._sdpa_chunk(chunk, meta.window) for chunk in fresh]
        continued = [chunk for chunk in meta.prefills if chunk.context_len > chunk.length and chunk.last_keys is None]
        meta.backend_state = ContextPrefill.of(continued, self.triton) if continued else None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sinks: gpt-oss's, in each kernel's softmax denominator (fresh prompts: sink_attention's scores)."""
        decoded = self.decode(layer, q[:meta.num_decodes], meta, sinks) if meta.num_decodes else None
        if not meta.prefills:
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:meta.num_decodes] = decoded
        self._attend_chunks(layer, q, k, v, meta, out, sinks)
        context = self._context_prefill(meta)
        if context is not None:
            self.triton.paged_prefill(q, self.k_cache[layer], self.v_cache[layer], out, context.tables,
                                      context.tile_chunks, context.tile_offsets, context.starts, context.lengths,
                                      context.context_lens, self.scale, meta.window, self._quantized(layer), sinks)
        return out

    def decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query per row [B, heads, d], read in place from the blocks of its table."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        splits = self.triton.num_splits(q.shape[0], self.k_cache[layer].shape[2], tables.shape[1] * self.block_size,
                                        self.multiprocessors)
        return self.triton.paged_decode(q, self.k_cache[layer], self.v_cache[layer], tables, lens, self.scale,
                                        meta.window_starts(lens), splits, self._quantized(layer), sinks)

    def _context_prefill(self, meta: AttentionMetadata) -> ContextPrefill | None:
        return meta.backend_state

    def _quantized(self, layer: int) -> QuantizedLayer | None:
        """A quantized layer's scales, for the kernels (None: the cache holds values)."""
        return None


@dataclass
class QuantizedStep:
    """What CudaQuantizedKVBackend.prepare() keeps for a step: the write's blocks and the continued chunks."""

    writes: BlockWrites | None  # channel-scaled keys' (int8, int4)
    context: ContextPrefill | None


class CudaQuantizedKVBackend(QuantizedKVBackend, CudaBackend):
    """QuantizedKVBackend's storage, write and gather (in its rows layout); CudaBackend's attention, whose kernels
    read the codes in place."""

    lane_layout = False
    per_layer_shapes = False  # slot views (Gemma 4's) of codes and scales: not yet run on a GPU, so refused

    def prepare(self, meta: AttentionMetadata) -> None:
        CudaBackend.prepare(self, meta)
        writes = BlockWrites.of(meta.slot_mapping, self.block_size) if self.format.key_channels else None
        meta.backend_state = QuantizedStep(writes, meta.backend_state)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMetadata,
                sinks: torch.Tensor | None = None, write: bool = True) -> torch.Tensor:
        meta = step[self.group_of_layer[layer]]
        if write:
            self.write(layer, k, v, meta.slot_mapping, meta.backend_state.writes)
        return self.attend(layer, q, k, v, meta, sinks)

    def _context_prefill(self, meta: AttentionMetadata) -> ContextPrefill | None:
        return meta.backend_state.context

    @cached_property
    def _quantized_layers(self) -> dict[int, QuantizedLayer]:
        return {layer: self.triton.QuantizedLayer(self.format, self.k_scales[layer], self.v_scales[layer])
                for layer in self.k_scales}

    def _quantized(self, layer: int) -> QuantizedLayer:
        return self._quantized_layers[layer]
