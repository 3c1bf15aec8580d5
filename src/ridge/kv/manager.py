"""KVManager: the one owner of block tables.

A sequence's block table maps its token positions to KV blocks (position p lives in block
table[p // block_size]); `num_computed` says how many of its tokens have K/V there. Only this manager
changes either, and a sequence's prefix-cache registration: the scheduler decides who runs and asks it
for room, the engine tells it what a step computed, and the sequence itself only carries the data.

With a prefix cache, a sequence admitted with nothing computed first takes the cached blocks of its
longest cached prefix. At least its last token is always computed (the step needs its logits), so a
hit never covers the block that holds it: the blocks a sequence writes are always its own, and a
shared block is never written (no copy-on-write is needed).

KV groups: every layer of the models ridge runs today keeps full-attention K/V of one shape, so the
manager has one group: one pool, one table per sequence. A model with layers of another kind
(sliding-window layers whose blocks behind the window are freed, a latent KV of another size, a
fixed-size recurrent state per sequence) adds a group with its own pool and table per sequence; each
method here is where a group's lifetime rule applies (a window group frees in commit()), so the
scheduler and the engine do not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from ridge.kv.block_pool import BlockPool
from ridge.kv.prefix_cache import PrefixCache, chain_key
from ridge.sampling_params import SamplingParams


class Sequence(Protocol):
    """What the manager reads and writes of a sequence (engine/sequence.py's, which kv/ does not import)."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    block_table: list[int]
    num_computed: int
    block_keys: list[bytes]  # the chained keys of the full blocks hashed so far
    num_registered: int  # how many of the table's blocks were offered to the prefix cache


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, block_size, self.cache)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a reservation can take: free ones and cached ones no sequence holds."""
        return self.pool.num_free

    # ---- admission -------------------------------------------------------------------------------
    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many of seq's tokens a take_cached_prefix() would find cached now (0 without a cache)."""
        if self.cache is None:
            return 0
        usable = self._hash_usable_blocks(seq)
        return len(self.cache.lookup(seq.block_keys[:usable])) * self.block_size

    def take_cached_prefix(self, seq: Sequence) -> None:
        """seq (holding nothing) takes the cached blocks of its longest cached prefix and counts them computed."""
        assert not seq.block_table and seq.num_computed == 0, "only a sequence holding no KV takes a cached prefix"
        if self.cache is None:
            return
        usable = self._hash_usable_blocks(seq)
        hit = self.cache.lookup(seq.block_keys[:usable])
        self.pool.share(hit)
        seq.block_table = hit
        seq.num_computed = len(hit) * self.block_size
        seq.num_registered = len(hit)

    def _hash_usable_blocks(self, seq: Sequence) -> int:
        """Hash seq's full blocks before the one holding its last token (the ones a hit may cover)."""
        usable = (len(seq.token_ids) - 1) // self.block_size
        self._hash_blocks(seq, usable)
        return usable

    def _hash_blocks(self, seq: Sequence, count: int) -> None:
        """Extend seq.block_keys to its first `count` full blocks (keys depend on tokens alone: they survive
        preemption)."""
        bs = self.block_size
        for i in range(len(seq.block_keys), count):
            parent = seq.block_keys[i - 1] if i else None
            seq.block_keys.append(chain_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.params.cache_salt))

    # ---- growth ----------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to hold its first num_tokens tokens; False (and nothing taken) if the pool is short."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """A step computed seq's next num_tokens tokens; blocks that are now full go into the prefix cache."""
        seq.num_computed += num_tokens
        if self.cache is None:
            return
        full = seq.num_computed // self.block_size
        if full > seq.num_registered:
            self._hash_blocks(seq, full)
            for i in range(seq.num_registered, full):
                self.cache.insert(seq.block_keys[i], seq.block_table[i])
            seq.num_registered = full

    def rewind(self, seq: Sequence, num_computed: int) -> None:
        """seq's tokens from num_computed on changed (a drafter's rejected drafts): their K/V is stale and
        will be computed again into the same blocks. Only for K/V no cache has seen."""
        assert num_computed >= seq.num_registered * self.block_size, "cached K/V cannot be rewound"
        seq.num_computed = min(seq.num_computed, num_computed)

    # ---- shrinking -------------------------------------------------------------------------------
    def trim(self, seq: Sequence) -> None:
        """Return the blocks past seq's tokens (reserved for drafts that were rejected): they hold no
        registered K/V, so nothing in them is lost."""
        keep = self.pool.blocks_for(len(seq.token_ids))
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """seq lets go of all its blocks (finished, aborted or preempted); none of its K/V counts as computed."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0

    @contextmanager
    def scratch(self, num_tokens: int) -> Iterator[list[int]]:
        """Blocks for a forward pass outside any request (scoring a text), given back when it ends."""
        blocks = self.pool.allocate(self.pool.blocks_for(num_tokens))
        try:
            yield blocks
        finally:
            self.pool.release(blocks)

    # ---- accounting ------------------------------------------------------------------------------
    def check_integrity(self, running: Iterable[Sequence], waiting: Iterable[Sequence] = ()) -> None:
        """Assert the accounting: refcounts equal the tables holding each block, a waiting sequence holds
        nothing, and a running one's table covers the K/V it has computed."""
        running = list(running)
        for seq in waiting:
            assert not seq.block_table, f"waiting sequence {seq.seq_id} holds KV blocks"
        for seq in running:
            assert len(seq.block_table) >= self.pool.blocks_for(seq.num_computed), (
                f"sequence {seq.seq_id}: {seq.num_computed} tokens computed in {len(seq.block_table)} blocks"
            )
            assert seq.num_registered <= len(seq.block_table), f"sequence {seq.seq_id} registered blocks it lacks"
        self.pool.check_integrity(seq.block_table for seq in running)

    def check_idle(self, full: bool = True) -> None:
        """With no request in the engine, every block is back: free, or parked in the prefix cache (counted at
        no cost); full: each block's refcount checked too (O(blocks))."""
        leaked = self.pool.num_blocks - self.pool.num_free
        assert leaked == 0, f"{leaked} KV blocks leaked with no request running"
        if full:
            self.pool.check_integrity([])
