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

Where layers differ in shape (Gemma 4's global layers: wider heads, fewer of them), a slot is a row of bytes per
block id, as wide as its widest group's layers there, and every layer views its part of the slot's rows in its own
shapes (KVLayout.carve). A kind whose layers are a whole fraction of the widest layer's width (kv heads x head
width) packs that many layers into each slot: Gemma 4 31B's global layers (4 KV heads of 512) are half as wide as
its windowed ones (16 of 256), so its 10 global layers make one group over 5 slots, two to a slot, beside 10
windowed groups of 5: a block id is 5 slots wide, and every group fills it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    # K/V tensors per block id: the j-th layer of each group uses slot j % num_slots (a group holds more layers than
    # slots where its layers pack several to a slot: the j-th is then part j // num_slots of its slot)
    num_slots: int
    # each layer's (kv heads, head width), where the layers differ in them; None: all the model's
    shapes: Mapping[int, tuple[int, int]] | None = field(default=None, compare=False)

    @property
    def has_windows(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def group_of_layer(self) -> dict[int, int]:
        """Each attention layer's group (layers without attention have none)."""
        return {layer: gi for gi, group in enumerate(self.groups) for layer in group.layers}

    def slot_of_layer(self) -> dict[int, int]:
        """Each attention layer's slot."""
        return {layer: j % self.num_slots for group in self.groups for j, layer in enumerate(group.layers)}

    def carve(self, layer_bytes: Callable[[int, int], int]) -> SlotCarving:
        """A layout with shapes, in bytes: each layer's bytes per block id from its (kv heads, head width), a group's
        layers in one slot side by side, each slot as wide as its widest group's."""
        assert self.shapes is not None, "a layout of uniform layers: one tensor per slot in the model's shape"
        offsets: dict[int, int] = {}
        slot_bytes = [0] * self.num_slots
        for group in self.groups:
            used = [0] * self.num_slots
            for j, layer in enumerate(group.layers):  # part j // num_slots of slot j % num_slots
                offsets[layer] = used[j % self.num_slots]
                used[j % self.num_slots] += layer_bytes(*self.shapes[layer])
            slot_bytes = [max(a, b) for a, b in zip(slot_bytes, used, strict=True)]
        return SlotCarving(slot_bytes, offsets)


@dataclass(frozen=True)
class SlotCarving:
    """Where each layer's cache sits in its slot's rows of bytes (a layout with shapes): a slot is one row of
    slot_bytes[slot] bytes per block id, and a layer's K and V (and a quantized cache's scales) are its bytes from
    offsets[layer] on, in every block's row."""

    slot_bytes: list[int]
    offsets: dict[int, int]

    @property
    def block_bytes(self) -> int:
        """What one block id holds over every slot."""
        return sum(self.slot_bytes)


def kv_layout(layer_windows: Sequence[Window | None] | Mapping[int, Window | None],
              shapes: Mapping[int, tuple[int, int]] | None = None) -> KVLayout:
    """Group the attention layers by their window (None: full attention), given for every layer in order or by
    layer index (a hybrid model's attention layers); groups of the smallest kind's size, the last of a kind
    possibly shorter (its unused slots then hold nothing). shapes: each layer's (kv heads, head width), where
    layers differ."""
    windows = layer_windows if isinstance(layer_windows, Mapping) else dict(enumerate(layer_windows))
    kinds: dict[Window | None, list[int]] = {}
    for layer, window in sorted(windows.items()):
        kinds.setdefault(window, []).append(layer)
    if not kinds:
        return KVLayout((), 0, shapes)
    packed = {window: _layers_per_slot(layers, shapes) for window, layers in kinds.items()}
    size = min(-(-len(layers) // packed[window]) for window, layers in kinds.items())
    groups = [
        KVGroup(tuple(layers[i:i + size * packed[window]]), window)
        for window, layers in sorted(kinds.items(), key=lambda kind: kind[0] is not None)  # full first
        for i in range(0, len(layers), size * packed[window])
    ]
    return KVLayout(tuple(groups), size, shapes)


def _layers_per_slot(layers: list[int], shapes: Mapping[int, tuple[int, int]] | None) -> int:
    """How many of a kind's layers share a slot: as many as fit whole in the widest layer's width (1 without
    shapes, or where a kind's layers differ among themselves)."""
    if shapes is None:
        return 1
    widths = {shapes[layer][0] * shapes[layer][1] for layer in layers}
    if len(widths) != 1:
        return 1
    (width,) = widths
    widest = max(heads * dim for heads, dim in shapes.values())
    return widest // width if widest % width == 0 else 1
