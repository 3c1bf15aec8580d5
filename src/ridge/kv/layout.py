"""Which layers share a block table, and how their K/V tensors share the pool's memory.

A KV group is a set of layers whose K/V follow one lifetime rule: full attention keeps every block of a
sequence; a window keeps only the blocks its next queries can see: a sliding window of w a sequence's last w
positions (a query at position p sees keys p - w < j <= p, as in HF transformers and llama.cpp), a chunked one
(Llama 4's local layers) those of the aligned chunk of w positions the next query falls in. Each sequence holds one
block table per group.

The groups draw their blocks from one pool, so memory moves freely between them: a short sequence needs
as many window blocks as full ones, a long one far fewer. That needs every block id to mean the same
memory in every group, so the groups have equal size (vLLM's hybrid allocator does the same): the layers
of one kind are cut into groups of `group_size` layers, and the j-th layer of every group reads and writes
the same K/V tensor ("slot" j) at its own group's block ids. Gemma-3's 5:1 local:global pattern over 18
layers is 1 full group and 5 window groups of 3 layers each, over 3 slots; a model with one kind of layer
is one group whose slots are its layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

Positions = TypeVar("Positions", int, torch.Tensor)


@dataclass(frozen=True)
class Window:
    """The keys a query sees beside the causal rule: the last `size` positions (a sliding window: a query at p sees
    p - size < j <= p), or, chunked, those of its own chunk of `size` positions aligned to 0 (p // size * size <=
    j <= p: Llama 4's local layers, whose first query of each chunk sees itself alone)."""

    size: int
    chunked: bool = False

    def first_key(self, position: Positions) -> Positions:
        """The first key a query at `position` sees (an int, or a tensor of positions); a later query's is never
        earlier, which is what lets a cache drop the blocks before the next query's first key."""
        if self.chunked:
            return position // self.size * self.size
        first = position - self.size + 1
        return first.clamp(min=0) if isinstance(first, torch.Tensor) else max(first, 0)


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]
    window: Window | None  # None: full attention


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # none in a model without attention layers (a pure state-space model)
    num_slots: int  # K/V tensors per block id: the j-th layer of each group uses slot j

    @property
    def has_windows(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def group_of_layer(self) -> dict[int, int]:
        """Each attention layer's group (layers without attention have none)."""
        return {layer: gi for gi, group in enumerate(self.groups) for layer in group.layers}

    def slot_of_layer(self) -> dict[int, int]:
        """Each attention layer's slot."""
        return {layer: slot for group in self.groups for slot, layer in enumerate(group.layers)}


def kv_layout(layer_windows: Sequence[Window | None] | Mapping[int, Window | None]) -> KVLayout:
    """Group the attention layers by their window (None: full attention), given for every layer in order or by
    layer index (a hybrid model's attention layers); groups of the smallest kind's size, the last of a kind
    possibly shorter (its unused slots then hold nothing)."""
    windows = layer_windows if isinstance(layer_windows, Mapping) else dict(enumerate(layer_windows))
    kinds: dict[Window | None, list[int]] = {}
    for layer, window in sorted(windows.items()):
        kinds.setdefault(window, []).append(layer)
    if not kinds:
        return KVLayout((), 0)
    size = min(len(layers) for layers in kinds.values())
    groups = [
        KVGroup(tuple(layers[i:i + size]), window)
        for window, layers in sorted(kinds.items(), key=lambda kind: kind[0] is not None)  # full first
        for i in range(0, len(layers), size)
    ]
    return KVLayout(tuple(groups), size)
