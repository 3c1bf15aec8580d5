"""Prefix caching: full KV blocks found again by the hash of everything up to and including them.

A block's key chains its parent's key with its own tokens (vLLM's scheme, and nano-vllm's), so one
dict lookup per block finds the longest cached prefix of a prompt, and a key depends on the content
alone: an evicted parent leaves its children merely unreachable, never wrong. Chosen over a radix tree
because sharing happens in whole blocks anyway and the block table is already the unit the pool,
the scheduler and the kernels work in. Keys are 128-bit BLAKE2b digests: a collision would hand one
request another's KV, so the hash must not be forgeable the way Python's hash() of a tuple is.

The first block's key starts from the request's cache_salt, so requests with different salts share
nothing: a shared cache is a timing side channel between tenants.

Cached blocks that no sequence holds are "parked": counted as free by the pool, kept in LRU order,
and evicted (oldest first) only when the pool has no truly free block left. A child is used after its
parent, so LRU order frees leaves before the prefixes they hang from.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached
    evictions: int = 0  # blocks whose cached KV was dropped to make room


def chain_key(parent: bytes | None, tokens: Sequence[int], salt: str | None = None, extra: bytes = b"") -> bytes:
    """The key of a block holding `tokens` after the prefix whose last block's key is `parent` (the first block's
    chains from `salt`); extra: what else its KV depends on, beside its tokens (the images its tokens stand for)."""
    h = hashlib.blake2b(parent if parent is not None else b"ridge-prefix:" + (salt or "").encode(), digest_size=16)
    h.update(array("I", tokens).tobytes())
    if extra:
        h.update(b"\0" + extra)
    return h.digest()


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stats = CacheStats()

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (a chain, first block first)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def block_of(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def insert(self, key: bytes, block: int) -> None:
        """Remember that `block` (full, held by a sequence) holds the KV keyed `key`. If another block already
        holds the same content (two sequences computed it at once), the first stays the cached one."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    # ---- called by the pool, which owns refcounts ------------------------------------------------
    def park(self, block: int) -> None:
        """No sequence holds this cached block any more: keep it, as the most recently used."""
        self._parked[block] = None

    def unpark(self, block: int) -> None:
        """A sequence takes a parked block again."""
        del self._parked[block]

    def evict(self) -> int:
        """Forget the least recently used parked block and return it for reuse."""
        block, _ = self._parked.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.stats.evictions += 1
        return block

    def check_integrity(self, refcount: list[int], free: set[int]) -> None:
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "cache maps disagree"
        assert len(self._block_of) == len(self._key_of), "cache maps disagree in size"
        for b in self._parked:
            assert refcount[b] == 0, f"block {b} is parked but held by {refcount[b]} block tables"
            assert b in self._key_of, f"block {b} is parked but not cached"
            assert b not in free, f"block {b} is both parked and free"
        for b in free:
            assert b not in self._key_of, f"block {b} is free but still cached"
