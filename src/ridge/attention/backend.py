"""The attention backend interface: write this step's K/V into the paged cache, attend over it.

The cache of one layer is [kv_heads, num_blocks, block_size, head_dim]: heads outermost, so that
gathering a sequence's blocks yields [kv_heads, tokens, head_dim] as a view, ready for a batched
matmul with no further copy. Slot s of the flat cache is (block s // block_size, offset s % block_size).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk in a step: query tokens flat[start:start+length]."""

    start: int
    length: int
    context_len: int  # tokens in the cache once this chunk is written (cached prefix + chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids


@dataclass
class AttentionMetadata:
    """Where each token of a step goes and what it attends to. Decode tokens come first in the flat batch."""

    slot_mapping: torch.Tensor  # [T] cache slot of every token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes], the new token included
    prefills: list[PrefillChunk]
    decode_mask: torch.Tensor | None = None  # filled by the backend's prepare()
    prefill_masks: list[torch.Tensor] | None = None


class AttentionBackend(ABC):
    """Owns the paged K/V tensors of every layer; stateless otherwise."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.scale = head_dim**-0.5
        self.ops: ModuleType | None = None  # kernels/cpu_ops.py: C++ cache writes (and decode, if the backend uses it)

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Per-step work shared by all layers (masks); called once before the forward pass."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] -> the cache slots of those tokens."""
        if self.ops is not None:
            self.ops.cache_write_(self.k_cache[layer], self.v_cache[layer], k, v, slots)
            return
        flat = (self.num_kv_heads, -1, self.head_dim)
        self.k_cache[layer].view(flat).index_copy_(1, slots, k.transpose(0, 1))
        self.v_cache[layer].view(flat).index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block ids [..., n] -> K, V of shape [kv_heads, ..., n * block_size, head_dim]."""
        k = self.k_cache[layer][:, block_table]
        v = self.v_cache[layer][:, block_table]
        shape = (*k.shape[:-3], k.shape[-3] * k.shape[-2], self.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        self.write(layer, k, v, meta.slot_mapping)
        return self.attend(layer, q, meta)

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...
