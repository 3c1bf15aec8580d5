"""Recurrent state: one fixed-size slot per sequence for the state-space layers.

The slots (StateSlots) also index an int2 cache's tails (attention/quantized_kv.py): a slot is a running
sequence's, whatever a model keeps in it.

A Mamba-2 layer carries a sequence's past as a state of fixed size, not as K/V that grows a block at a time:
the last conv_kernel - 1 inputs of its causal convolution and an SSM state of [heads, head_dim, state_size].
A running sequence holds one slot, the same index in every state-space layer's tensors, from its first step
until it finishes or is preempted (kv/manager.py takes and gives back slots with its blocks). A slot's
contents are the sequence's state after its first num_computed tokens: it is zeroed when the sequence computes
its first token, so a preempted sequence starts again from nothing and recomputes (a state cannot be cut back
to an earlier token, as a block table can).

States stay in float32 whatever the model's dtype: the scan adds into them at every token of a sequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


class StateSlots:
    """Which slots are free; a slot is held by at most one sequence."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"state slot {slot} released twice"
        self._free.append(slot)

    def check_integrity(self, held: Iterable[int]) -> None:
        """Every slot is free or held by exactly one sequence."""
        held = list(held)
        assert len(set(held)) == len(held), f"a state slot is held by two sequences: {sorted(held)}"
        assert not set(held) & set(self._free), "a held state slot is also free"
        assert len(held) + len(self._free) == self.num_slots, (
            f"{self.num_slots - len(held) - len(self._free)} state slots leaked")


class StateCache:
    """The state tensors of every state-space layer, num_slots deep."""

    def __init__(self, layers: Iterable[int], num_slots: int, conv_channels: int, conv_kernel: int, heads: int,
                 head_dim: int, state_size: int, device: str | torch.device) -> None:
        self.conv = {i: torch.zeros(num_slots, conv_channels, conv_kernel - 1, device=device) for i in layers}
        self.ssm = {i: torch.zeros(num_slots, heads, head_dim, state_size, device=device) for i in self.conv}

    def copy_(self, pairs: torch.Tensor) -> None:
        """pairs [n, 2]: the state of slot pairs[i, 0] copied into slot pairs[i, 1] (snapshots taken or restored)."""
        source, target = pairs[:, 0], pairs[:, 1]
        for tensors in (self.conv, self.ssm):
            for t in tensors.values():
                t.index_copy_(0, target, t.index_select(0, source))

    def zero_(self, slots: torch.Tensor) -> None:
        """Start the sequences of these slots from an empty past."""
        for layer in self.conv:
            self.conv[layer].index_fill_(0, slots, 0.0)
            self.ssm[layer].index_fill_(0, slots, 0.0)

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for tensors in (self.conv, self.ssm) for t in tensors.values())


@dataclass
class StateStep:
    """The state slots a step reads and writes: the step's sequences in its order (decodes first, one token
    each, then prefill chunks at flat[start:start + length]). Which slots, not their contents: each tensor-parallel
    rank runs a step with its own cache (its heads' states), so the runner that runs it binds `cache`, zeroes `fresh`
    (the slots of sequences computing their first token) and copies snapshots in it."""

    cache: StateCache | None
    slots: torch.Tensor  # [sequences] slot of each
    num_decodes: int
    chunks: list[tuple[int, int]]  # (start, length) of each prefill chunk in the flat tokens
    fresh: torch.Tensor | None = None  # slots to zero before the step
    # with state snapshots (kv/state_snapshots.py): [n, 2] (snapshot, sequence slot) pairs copied before the step,
    # and (sequence, snapshot slot) pairs copied after it
    restores: torch.Tensor | None = None
    saves: torch.Tensor | None = None
