"""Fixed-size KV blocks: a free list and refcounts.

Invariant (checked by check_integrity): a block's refcount equals the number of block tables that
hold it, and a block is on the free list exactly when its refcount is 0.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: need at least 1 KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1, or NoFreeBlocks (and nothing taken)."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Another block table now holds these blocks too."""
        for b in blocks:
            assert self.refcount[b] > 0, f"block {b} is free and cannot be shared"
            self.refcount[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """A block table lets go of these blocks; the last holder returns them to the free list."""
        for b in blocks:
            assert self.refcount[b] > 0, f"block {b} released more often than held"
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Raise AssertionError if the refcounts disagree with the live block tables."""
        held = Counter(b for table in block_tables for b in table)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert self.refcount[b] == held.get(b, 0), (
                f"block {b}: refcount {self.refcount[b]} but held by {held.get(b, 0)} block tables"
            )
            assert (b in free) == (self.refcount[b] == 0), f"block {b}: free-list membership disagrees"
