"""Fixed-size KV blocks: a free list and refcounts, and (optionally) a prefix cache's parked blocks.

Invariant (checked by check_integrity): a block's refcount equals the number of block tables that
hold it. A block with refcount 0 is either on the free list or, when its KV is in the prefix cache,
parked there; allocate() takes free blocks first and evicts parked ones only when none are left.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from ridge.kv.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be at least 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.cache = cache

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: free ones and parked cached ones."""
        return len(self._free) + (self.cache.num_parked if self.cache is not None else 0)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1, or NoFreeBlocks (and nothing taken)."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = [self._free.popleft() if self._free else self.cache.evict() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Another block table now holds these blocks too (a parked cached block is taken back)."""
        for b in blocks:
            if self.refcount[b] == 0:
                assert self.cache is not None and self.cache.is_cached(b), f"block {b} is free and cannot be shared"
                self.cache.unpark(b)
            self.refcount[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """A block table lets go of these blocks; the last holder returns them to the free list."""
        for b in blocks:
            assert self.refcount[b] > 0, f"block {b} released more often than held"
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.cache is not None and self.cache.is_cached(b):
                    self.cache.park(b)
                else:
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
            if self.refcount[b] > 0:
                assert b not in free, f"block {b} is held and on the free list"
        if self.cache is not None:
            self.cache.check_integrity(self.refcount, free)
        assert len(free) + (self.cache.num_parked if self.cache else 0) + sum(r > 0 for r in self.refcount) \
            == self.num_blocks, "a block with refcount 0 is neither free nor parked"
