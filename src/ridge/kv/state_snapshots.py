"""State snapshots: prefix caching for models with state-space layers.

A Mamba layer's state after position p summarises every token up to p, so a cached prefix is usable only together
with the state where it ends. The engine keeps snapshots, copies of a sequence's state at block boundaries, in
slots of their own after the running sequences' (the StateCache's slots first_slot..first_slot + num_slots - 1),
each keyed by the prefix-cache key of the prefix's last block (kv/prefix_cache.py: a key names its whole prefix,
salt included). A sequence admitted with a cached prefix starts from the longest one that has a snapshot (and, in
a hybrid, its KV blocks), its state copied from the snapshot before its first step (kv/manager.py).

Where snapshots are taken, at block boundaries since prefixes are whole blocks (SGLang's Mamba radix cache keeps
states at a request's end and at branch points likewise):
- the end of a prompt's last full block before its last token: a repeated prompt, a request's other samples and
  the next turn of a conversation start there;
- the branch point: the end of the longest prefix of the prompt that earlier sequences computed (its blocks' keys
  were seen) but that has no snapshot: the shared system prompt of requests that differ after it. The first such
  request computes through it and leaves a snapshot there; the ones after it start from it;
- each block boundary its decode reaches, each replacing the one before (a sequence keeps one such snapshot): the
  last one a reply reached stays, where the conversation's next turn, which repeats the reply, starts.
The scheduler ends a prefill chunk at each of a sequence's snapshot points; the runner copies the state into the
snapshot's slot after the step's forward pass, and the manager registers it once the step is committed.

Slots are reused least recently used first. A slot taken for a snapshot whose step has not been committed yet is
pending: its sequence holds it (and gives it back if freed first), and it is not evictable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# keys of computed blocks remembered to find branch points (16 bytes each): far more than any pool holds blocks
SEEN_KEYS = 1 << 17


class StateSnapshots:
    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.first_slot, self.num_slots = first_slot, num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # popped from the end
        self._pending: set[int] = set()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        """Snapshots kept (pending ones not counted)."""
        return len(self._slot_of)

    def longest(self, keys: Sequence[bytes]) -> tuple[int, int | None]:
        """The longest prefix of keys (in blocks) that has a snapshot, and its slot (0, None: none)."""
        for length in range(len(keys), 0, -1):
            slot = self._slot_of.get(keys[length - 1])
            if slot is not None:
                return length, slot
        return 0, None

    def use(self, key: bytes) -> None:
        """A sequence starts from the snapshot keyed `key`: the most recently used now."""
        self._slot_of.move_to_end(key)

    def seen_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys name blocks some sequence computed (the branch point of a prompt)."""
        length = 0
        while length < len(keys) and keys[length] in self._seen:
            length += 1
        return length

    def see(self, keys: Iterable[bytes]) -> None:
        """Blocks a sequence computed, by key."""
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > SEEN_KEYS:
            self._seen.popitem(last=False)

    def take(self, replacing: bytes | None = None) -> int | None:
        """A slot for a new snapshot, pending until register() or drop(): a free one, or the least recently used
        snapshot's (forgotten); None when every slot is pending. replacing: the key of a snapshot the new one
        supersedes, forgotten first (a decoding sequence's previous one)."""
        if replacing is not None and (slot := self._slot_of.pop(replacing, None)) is not None:
            self._free.append(slot)
        if not self._free:
            if not self._slot_of:
                return None
            _, slot = self._slot_of.popitem(last=False)
            self._free.append(slot)
            self.evictions += 1
        slot = self._free.pop()
        self._pending.add(slot)
        return slot

    def register(self, key: bytes, slot: int) -> bool:
        """The pending slot now holds the state at the end of the prefix keyed `key`; whether it is kept: where
        another sequence's snapshot of the same prefix got there first, that one stays and this slot is freed."""
        self._pending.remove(slot)
        if key in self._slot_of:
            self._free.append(slot)
            return False
        self._slot_of[key] = slot
        return True

    def drop(self, slot: int) -> None:
        """A pending slot whose snapshot will not be taken (its sequence was freed first)."""
        self._pending.remove(slot)
        self._free.append(slot)

    def check_integrity(self, pending: Iterable[int]) -> None:
        """Every slot is free, pending for exactly one running sequence, or one snapshot's."""
        pending = list(pending)
        assert len(set(pending)) == len(pending), f"a snapshot slot is pending for two sequences: {sorted(pending)}"
        assert set(pending) == self._pending, "pending snapshot slots disagree with the sequences holding them"
        kept = list(self._slot_of.values())
        assert len(set(kept)) == len(kept), "two snapshots share a slot"
        everything = [*self._free, *self._pending, *kept]
        assert sorted(everything) == list(range(self.first_slot, self.first_slot + self.num_slots)), (
            "snapshot slots leaked or counted twice")
