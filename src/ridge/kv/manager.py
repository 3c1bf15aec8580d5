"""KVManager: the one owner of block tables.

A sequence holds one block table per KV group (kv/layout.py): position p of the group's layers lives in
block table[p // block_size]. `num_computed` says how many of its tokens have K/V there, in every group.
Only this manager changes either, and a sequence's prefix-cache registration: the scheduler decides who
runs and asks it for room, the engine tells it what a step computed, and the sequence itself only carries
the data.

Window groups: once a sequence has computed n tokens, its next query sits at position n or later and sees no key
before its window's first key (n - window + 1 for a sliding one, n's chunk start for a chunked one), so commit()
gives every block wholly before that back to the pool
(a cached one stays findable, parked). The table keeps its length; a dropped entry holds the null block,
a block id reserved for that which no kernel reads (the backends read a window group from its window's
start). A manager that must rewind (the draft model's) keeps `rewind_margin` more positions.

Prefix caching: a sequence admitted with nothing computed first takes the cached blocks of its longest
cached prefix. At least its last token is always computed (the step needs its logits), so a hit never
covers the block that holds it: the blocks a sequence writes are always its own, and a shared block is
never written (no copy-on-write is needed). A hit of L blocks needs, in a full group, all of blocks
[0, L) cached, and in a window group only the blocks its window reaches from position L * block_size
(vLLM's rule): the hit is the longest L every group can serve. Each group caches its own blocks, under
the same content keys tagged with the group.

Eviction (kv/eviction.py): commit() drops the blocks the policy picks (sink-window: the oldest after the sinks;
h2o: those with the least attention mass) once a sequence holds more than its budget, deleting them from its
tables (not nulling them: the kept blocks stay side by side, and `num_evicted` maps the next position to its index
there). Only blocks computed before a sequence's first eviction are offered to the prefix cache: later ones were
computed over a cache with holes.

Sequence slots (kv/state_cache.py): a model with state-space layers, or a cache that keeps tails (int2: the rows
of the block a sequence is filling, attention/quantized_kv.py), also needs one slot per running sequence, taken
with its first blocks and given back with them. A tail holds less than a block, and a cached prefix is whole blocks.
A state summarises all of a sequence's tokens, so a state-space model's cached prefix also needs a snapshot of the
state where it ends (kv/state_snapshots.py): a hit is the longest cached prefix that has one, the sequence's state
copied from it before its first step, and the chunks of a prefill end where it leaves snapshots of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from ridge.kv.block_pool import BlockPool
from ridge.kv.eviction import Eviction
from ridge.kv.layout import KVLayout, Window, kv_layout
from ridge.kv.prefix_cache import PrefixCache, chain_key
from ridge.kv.state_cache import StateSlots
from ridge.kv.state_snapshots import StateSnapshots
from ridge.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class Sequence(Protocol):
    """What the manager reads and writes of a sequence (engine/sequence.py's, which kv/ does not import)."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    block_tables: list[list[int]]  # one per KV group
    num_computed: int
    num_evicted: int  # positions whose blocks eviction gave back
    max_evicted: int
    block_mass: dict[int, float]  # h2o: the attention each block it holds received, by block id
    block_keys: list[bytes]  # the chained keys of the full blocks hashed so far
    num_registered: int  # how many of each table's blocks were offered to the prefix cache
    state_slot: int | None  # its slot (recurrent state, KV tail), while it holds one
    restore_from: int | None  # the snapshot slot its state starts from, until its first step is committed
    snapshot_points: list[int]  # positions its prefill stops at to leave a snapshot
    pending_snapshot: tuple[int, int] | None  # (position, slot) of the snapshot its current step leaves


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 layout: KVLayout | None = None, rewind_margin: int = 0, num_state_slots: int = 0,
                 eviction: Eviction | None = None, num_snapshots: int = 0) -> None:
        """num_state_slots: sequences that can hold a slot at once (0: the model and cache need none);
        num_snapshots: slots for state snapshots after those (kv/state_snapshots.py), for prefix caching on a model
        with state-space layers."""
        self.layout = layout or kv_layout([None])
        self.windows = [group.window for group in self.layout.groups]
        assert not (eviction and (self.layout.has_windows or rewind_margin)), "eviction: full attention, no rewinds"
        assert not num_snapshots or (enable_prefix_caching and num_state_slots and eviction is None
                                     and not self.layout.has_windows and not rewind_margin), "snapshots: see above"
        self.eviction = eviction
        self.states = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshots = StateSnapshots(num_state_slots, num_snapshots) if num_snapshots else None
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, block_size, self.cache)
        self.rewind_margin = rewind_margin
        # held by the manager for as long as it lives: the entry of a dropped block
        self.null_block = self.pool.allocate(1)[0] if self.layout.has_windows else None

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

    def empty_tables(self) -> list[list[int]]:
        return [[] for _ in self.windows]

    def window_start_block(self, group: int, num_computed: int) -> int:
        """The first block the window of a query at position num_computed reaches (0 in a full group)."""
        window = self.windows[group]
        return 0 if window is None else window.first_key(num_computed) // self.block_size

    def first_live_block(self, group: int, num_computed: int) -> int:
        """The first block of `group` a sequence with num_computed tokens computed still holds."""
        return self.window_start_block(group, max(0, num_computed - self.rewind_margin))

    # ---- admission -------------------------------------------------------------------------------
    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many of seq's tokens a take_cached_prefix() would find cached now (0 without a cache)."""
        if self.cache is None or seq.scores_prompt:
            return 0
        hit = self._lookup(seq)[0]
        if self.snapshots is not None:
            hit = self.snapshots.longest(seq.block_keys[:hit])[0]
        return hit * self.block_size

    def take_cached_prefix(self, seq: Sequence) -> None:
        """seq (holding nothing) takes the cached blocks of its longest cached prefix and counts them computed; with
        state snapshots, of the longest that has one, which its first step starts its state from."""
        assert not any(seq.block_tables) and seq.num_computed == 0, "only a sequence holding no KV takes a prefix"
        if self.cache is None or seq.scores_prompt:
            return
        hit, tables = self._lookup(seq)
        if self.snapshots is not None:
            hit, seq.restore_from = self.snapshots.longest(seq.block_keys[:hit])
            if seq.restore_from is not None:
                self.snapshots.use(seq.block_keys[hit - 1])
            tables = [table[:hit] for table in tables]  # no window groups here: every table is its blocks
            seq.snapshot_points = self._snapshot_points(seq, hit)
        for table in tables:
            self.pool.share(b for b in table if b != self.null_block)
        seq.block_tables = tables
        seq.num_computed = hit * self.block_size
        seq.num_registered = hit

    def _snapshot_points(self, seq: Sequence, hit: int) -> list[int]:
        """Where seq's prefill should leave snapshots: the end of the prefix earlier sequences computed (its branch
        point from them) and of its prompt's last full block before the last token, past its hit."""
        usable = (len(seq.token_ids) - 1) // self.block_size  # _lookup hashed these
        branch = self.snapshots.seen_prefix(seq.block_keys[:usable])
        return [blocks * self.block_size for blocks in sorted({branch, usable}) if blocks > hit]

    def chunk_end(self, seq: Sequence, end: int) -> int:
        """Where a step computing seq's tokens up to `end` must stop: at the first of its snapshot points before; and
        not inside a span of tokens that attend both ways (before it, or where the chunk starts in it, nowhere:
        the sequence waits for a step with room for the rest of it)."""
        end = next((p for p in seq.snapshot_points if seq.num_computed < p < end), end)
        for start, stop in seq.bidirectional_spans:
            if start < end < stop:
                return max(start, seq.num_computed)
        return end

    def _lookup(self, seq: Sequence) -> tuple[int, list[list[int]]]:
        """The longest hit every group can serve, in blocks, and each group's table for it."""
        usable = (len(seq.token_ids) - 1) // self.block_size  # full blocks before the one holding the last token
        if self.eviction is not None:  # no more than a sequence may hold
            usable = min(usable, self.eviction.budget // self.block_size)
        self._hash_blocks(seq, usable)
        return self.cached_tables(seq.block_keys[:usable])

    def cached_tables(self, keys: list[bytes]) -> tuple[int, list[list[int]]]:
        """The longest prefix of `keys` every group has cached, in blocks, and each group's table for it (a window
        group's holds the null block before its window)."""
        if self.cache is None:
            return 0, [[] for _ in self.windows]
        found = [self.cache.lookup(self._group_keys(g, keys)) if w is None else None
                 for g, w in enumerate(self.windows)]
        hit = min((len(blocks) for blocks in found if blocks is not None), default=len(keys))
        while True:  # a window group's hit may end earlier; then every group's must
            shorter = min((self._window_hit(g, keys, hit) for g, w in enumerate(self.windows) if w is not None),
                          default=hit)
            if shorter == hit:
                break
            hit = shorter
        tables = []
        for g, blocks in enumerate(found):
            if blocks is not None:
                tables.append(blocks[:hit])
            else:  # the blocks _window_hit found cached
                start = self.window_start_block(g, hit * self.block_size)
                cached = [self.cache.block_of(self._group_key(g, key)) for key in keys[start:hit]]
                tables.append([self.null_block] * start + cached)
        return hit, tables

    def _window_hit(self, group: int, keys: list[bytes], limit: int) -> int:
        """The longest hit of at most `limit` blocks whose window blocks `group` has cached."""
        end = limit
        while end > 0:
            need = self.window_start_block(group, end * self.block_size)
            missing = next((i for i in range(end - 1, need - 1, -1)
                            if self.cache.block_of(self._group_key(group, keys[i])) is None), None)
            if missing is None:
                return end
            end = missing  # a hit must end before the missing block
        return 0

    @staticmethod
    def _group_key(group: int, key: bytes) -> bytes:
        return key if group == 0 else key + group.to_bytes(2, "little")

    def _group_keys(self, group: int, keys: list[bytes]) -> list[bytes]:
        return keys if group == 0 else [self._group_key(group, k) for k in keys]

    def _hash_blocks(self, seq: Sequence, count: int) -> None:
        """Extend seq.block_keys to its first `count` full blocks (keys depend on tokens alone: they survive
        preemption)."""
        bs = self.block_size
        for i in range(len(seq.block_keys), count):
            parent = seq.block_keys[i - 1] if i else None
            seq.block_keys.append(chain_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.prefix_salt,
                                            seq.block_images(i, bs)))

    # ---- cached prefixes moved between engines (disaggregated prefill: engine/kv_transfer.py) ----------------
    def prefix_keys(self, token_ids: list[int], salt: str | None) -> list[bytes]:
        """The prefix-cache keys of token_ids' full blocks, as a sequence of those tokens would key them."""
        bs, keys = self.block_size, []
        for i in range(len(token_ids) // bs):
            keys.append(chain_key(keys[-1] if keys else None, token_ids[i * bs:(i + 1) * bs], salt))
        return keys

    def exportable_tables(self, keys: list[bytes]) -> tuple[int, list[list[tuple[int, int]]]]:
        """The longest prefix of `keys` every group has cached, in blocks, and each group's cached blocks for it as
        (index in keys, block): a window group's from the window of a hit one block shorter (the hit of a prompt
        whose last token opens a new block: a prefix hit never takes the block holding the last token)."""
        hit, tables = self.cached_tables(keys)
        groups = []
        for g, table in enumerate(tables):
            first = self.window_start_block(g, max(hit - 1, 0) * self.block_size)
            cached = [(i, table[i] if table[i] != self.null_block else self.cache.block_of(self._group_key(g, keys[i])))
                      for i in range(first, hit)]
            groups.append([(i, block) for i, block in cached if block is not None and block != self.null_block])
        return hit, groups

    def adopt(self, keys: list[bytes], groups: list[list[int]]) -> list[tuple[int, int]]:
        """Free blocks for the blocks the cache does not hold yet of each group's `keys` (group g's, by index
        into keys: groups[g]), entered in the prefix cache and parked (no sequence holds them; LRU evicts them like
        any other): (row, block) of each, the row counting the groups' blocks in order, for the caller to fill
        before anything else runs. Stops at the first block it cannot place (no free block): a later one would be
        unreachable without it."""
        assert self.cache is not None and len(groups) == len(self.layout.groups)
        placed, row = [], 0
        for g, indices in enumerate(groups):
            for i in indices:
                key = self._group_key(g, keys[i])
                if self.cache.block_of(key) is None:
                    if self.pool.num_free < 1:
                        self.pool.release(block for _, block in placed)
                        return placed
                    [block] = self.pool.allocate(1)
                    self.cache.insert(key, block)
                    placed.append((row, block))
                row += 1
        self.pool.release(block for _, block in placed)
        return placed

    # ---- growth ----------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's tables to hold its first num_tokens tokens; False (and nothing taken) if the pool is short."""
        if not seq.block_tables:  # a sequence new to this manager
            seq.block_tables = self.empty_tables()
        want = self.pool.blocks_for(num_tokens - seq.num_evicted)
        needs = [want - len(table) for table in seq.block_tables]
        if sum(n for n in needs if n > 0) > self.pool.num_free:
            return False
        if self.states is not None and seq.state_slot is None:
            if (slot := self.states.allocate()) is None:
                return False
            seq.state_slot = slot
        for table, need in zip(seq.block_tables, needs, strict=True):
            if need > 0:
                table.extend(self.pool.allocate(need))
        # a step ending at a snapshot point, or at a block boundary in the output, takes a slot to copy the state
        # into (none when every one is pending); the output's replace the sequence's previous one
        if self.snapshots is not None and seq.pending_snapshot is None:
            in_output = num_tokens > seq.prompt_len and num_tokens % self.block_size == 0
            if num_tokens in seq.snapshot_points or in_output:
                slot = self.snapshots.take(replacing=seq.decode_snapshot if in_output else None)
                if slot is not None:
                    seq.pending_snapshot = (num_tokens, slot)
        return True

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """A step computed seq's next num_tokens tokens: blocks that are now full go into the prefix cache,
        and window groups drop the blocks their window has passed."""
        before = seq.num_computed
        seq.num_computed += num_tokens
        if self.cache is not None and not seq.num_evicted:
            full = seq.num_computed // self.block_size
            if full > seq.num_registered:
                self._hash_blocks(seq, full)
                for g, table in enumerate(seq.block_tables):
                    for i in range(seq.num_registered, full):
                        if table[i] != self.null_block:
                            self.cache.insert(self._group_key(g, seq.block_keys[i]), table[i])
                if self.snapshots is not None:
                    self.snapshots.see(seq.block_keys[seq.num_registered:full])
                seq.num_registered = full
        if self.snapshots is not None:
            self._commit_snapshot(seq)
        for g, window in enumerate(self.windows):
            if window is not None:
                self._drop(seq.block_tables[g], self.first_live_block(g, before),
                           self.first_live_block(g, seq.num_computed))
        if self.eviction is not None and self.eviction.blocks_to_evict(cached := seq.num_computed - seq.num_evicted):
            victims = self.eviction.victims(cached, seq.block_tables[0], seq.block_mass)
            for table in seq.block_tables:
                self.pool.release(table[i] for i in victims)
                for i in reversed(victims):
                    seq.block_mass.pop(table[i], None)
                    del table[i]
            seq.num_evicted += len(victims) * self.block_size
            seq.max_evicted = max(seq.max_evicted, seq.num_evicted)

    def _commit_snapshot(self, seq: Sequence) -> None:
        """After a step of seq: its restore done, the snapshot it left registered."""
        seq.restore_from = None
        if seq.pending_snapshot is not None:
            position, slot = seq.pending_snapshot
            assert seq.num_computed == position, "a step leaving a snapshot ends at its point"
            key = seq.block_keys[position // self.block_size - 1]
            if self.snapshots.register(key, slot) and position > seq.prompt_len:
                seq.decode_snapshot = key
            seq.pending_snapshot = None
        seq.snapshot_points = [p for p in seq.snapshot_points if p > seq.num_computed]

    def record_attention(self, seqs: list[Sequence], mass: torch.Tensor) -> None:
        """A step's attention mass [len(seqs), width] (attention/backend.py's AttentionMetadata.attention_mass),
        row i over the blocks of seqs[i]'s table as the step read it, added to what each block received."""
        for seq, row in zip(seqs, mass.tolist(), strict=True):
            for block, received in zip(seq.block_tables[0], row, strict=False):
                seq.block_mass[block] = seq.block_mass.get(block, 0.0) + received

    def _drop(self, table: list[int], start: int, end: int) -> None:
        for i in range(start, min(end, len(table))):
            if table[i] != self.null_block:
                self.pool.release([table[i]])
                table[i] = self.null_block

    def rewind(self, seq: Sequence, num_computed: int) -> None:
        """seq's tokens from num_computed on changed (a drafter's rejected drafts): their K/V is stale and
        will be computed again into the same blocks. Only for K/V no cache has seen. Further back than the
        rewind margin, a window group may have dropped blocks the new tokens see: seq then starts over."""
        assert num_computed >= seq.num_registered * self.block_size, "cached K/V cannot be rewound"
        if self.layout.has_windows and num_computed < seq.num_computed - self.rewind_margin:
            self.free(seq)
        seq.num_computed = min(seq.num_computed, num_computed)

    def _bounded_blocks(self, window: Window | None, num_tokens: int, chunk_tokens: int) -> int | None:
        """The most blocks one group holds for a sequence of num_tokens tokens computed in chunks of at most
        chunk_tokens when that is bounded: a window group's window (an evicting cache's budget) and the chunk being
        computed, each possibly straddling a block edge. None for a full group, which holds every block."""
        if self.eviction is not None:
            bound = self.eviction.budget + chunk_tokens
        elif window is not None:
            bound = window.size + self.rewind_margin + chunk_tokens  # a chunked window holds no more
        else:
            return None
        return self.pool.blocks_for(min(bound, num_tokens)) + 1

    def blocks_to_hold(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds while they are computed in chunks of at most
        chunk_tokens, over all groups."""
        return sum(held if (held := self._bounded_blocks(w, num_tokens, chunk_tokens)) is not None
                   else self.pool.blocks_for(num_tokens) for w in self.windows)

    def max_sequence_tokens(self, chunk_tokens: int, max_len: int = 2**62) -> int:
        """The longest sequence the pool can hold alone, computed in chunks of at most chunk_tokens, of at most
        max_len tokens (what a group holds is bounded by the sequence's length too)."""
        usable = self.num_blocks - (self.null_block is not None)
        full_groups = sum(w is None for w in self.windows)
        if self.eviction is not None:  # a sequence holds its budget and a chunk, whatever its length
            held = self._bounded_blocks(None, max_len, chunk_tokens)
            return 2**62 if usable >= held * full_groups else 0
        windowed = sum(self._bounded_blocks(w, max_len, chunk_tokens) for w in self.windows if w is not None)
        if full_groups == 0:
            return 2**62 if usable >= windowed else 0  # bounded by positions alone
        return max(0, usable - windowed) // full_groups * self.block_size

    # ---- shrinking -------------------------------------------------------------------------------
    def trim(self, seq: Sequence) -> None:
        """Return the blocks past seq's tokens (reserved for drafts that were rejected): they hold no
        registered K/V, so nothing in them is lost."""
        keep = self.pool.blocks_for(len(seq.token_ids) - seq.num_evicted)
        for table in seq.block_tables:
            if len(table) > keep:
                self.pool.release(table[keep:])
                for block in table[keep:]:
                    seq.block_mass.pop(block, None)
                del table[keep:]

    def free(self, seq: Sequence) -> None:
        """seq lets go of all its blocks (finished, aborted or preempted); none of its K/V counts as computed."""
        for table in seq.block_tables:
            self.pool.release(b for b in table if b != self.null_block)
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
        if seq.pending_snapshot is not None:
            self.snapshots.drop(seq.pending_snapshot[1])
        seq.restore_from, seq.snapshot_points, seq.pending_snapshot, seq.decode_snapshot = None, [], None, None
        seq.block_tables = self.empty_tables()
        seq.num_computed = seq.num_registered = seq.num_evicted = 0
        seq.block_mass.clear()

    @contextmanager
    def scratch(self, num_tokens: int) -> Iterator[tuple[list[list[int]], int | None]]:
        """Tables of every group, and a slot where the model has recurrent state or the cache tails, for a forward pass
        outside any request (scoring a text), given back when it ends."""
        tables, slot = [], None
        try:
            for _ in self.windows:
                tables.append(self.pool.allocate(self.pool.blocks_for(num_tokens)))
            if self.states is not None and (slot := self.states.allocate()) is None:
                raise ValueError("no free state slot: every one is held by a running sequence")
            yield tables, slot
        finally:
            for table in tables:
                self.pool.release(table)
            if slot is not None:
                self.states.release(slot)

    # ---- accounting ------------------------------------------------------------------------------
    def _held(self, tables: Iterable[list[int]]) -> Iterator[list[int]]:
        if self.null_block is not None:
            yield [self.null_block]
        for table in tables:
            yield [b for b in table if b != self.null_block] if self.null_block is not None else table

    def check_integrity(self, running: Iterable[Sequence], waiting: Iterable[Sequence] = ()) -> None:
        """Assert the accounting: refcounts equal the tables holding each block, a waiting sequence holds
        nothing, a running one's tables cover the K/V it has computed and hold every block its window
        still reaches."""
        running = list(running)
        for seq in waiting:
            assert not any(seq.block_tables), f"waiting sequence {seq.seq_id} holds KV blocks"
            assert seq.state_slot is None, f"waiting sequence {seq.seq_id} holds a state slot"
            assert seq.pending_snapshot is None, f"waiting sequence {seq.seq_id} holds a snapshot slot"
        if self.states is not None:
            assert all(seq.state_slot is not None for seq in running), "a running sequence holds no state slot"
            self.states.check_integrity(seq.state_slot for seq in running)
        if self.snapshots is not None:
            self.snapshots.check_integrity(s.pending_snapshot[1] for s in running if s.pending_snapshot is not None)
        for seq in running:
            assert len(seq.block_tables) == len(self.windows), f"sequence {seq.seq_id}: one table per KV group"
            cached = seq.num_computed - seq.num_evicted
            if self.eviction is not None:
                assert cached <= self.eviction.budget, f"sequence {seq.seq_id} holds {cached} tokens over its budget"
            else:
                assert not seq.num_evicted, f"sequence {seq.seq_id} evicted tokens with no eviction policy"
            for g, table in enumerate(seq.block_tables):
                assert len(table) >= self.pool.blocks_for(cached), (
                    f"sequence {seq.seq_id}: {seq.num_computed} tokens computed, {cached} of them cached, in "
                    f"{len(table)} blocks of group {g}"
                )
                needed = table[self.window_start_block(g, seq.num_computed):]
                assert self.null_block not in needed, f"sequence {seq.seq_id} dropped a block its window needs"
                assert seq.num_registered <= len(table) + seq.num_evicted // self.block_size, (
                    f"sequence {seq.seq_id} registered blocks it lacks")
        self.pool.check_integrity(self._held(table for seq in running for table in seq.block_tables))

    def check_idle(self, full: bool = True) -> None:
        """With no request in the engine, every block is back: free, or parked in the prefix cache (counted at
        no cost); full: each block's refcount checked too (O(blocks))."""
        leaked = self.pool.num_blocks - self.pool.num_free - (self.null_block is not None)
        assert leaked == 0, f"{leaked} KV blocks leaked with no request running"
        if self.states is not None:
            self.states.check_integrity([])
        if self.snapshots is not None:
            self.snapshots.check_integrity([])
        if full:
            self.pool.check_integrity(self._held([]))
