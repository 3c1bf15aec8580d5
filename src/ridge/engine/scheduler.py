"""Who runs this step: continuous batching under a token budget, chunked prefill, recompute preemption.

Each step fills `max_num_batched_tokens`: running decodes first (one token each), then the prompt
chunks of running sequences that are still prefilling, then new sequences from the waiting queue,
whose long prompts are cut to whatever budget is left. When KV blocks run out, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to recompute
its tokens later. The oldest sequence therefore always progresses, so nothing stalls forever:
a single sequence always fits, because max_model_len never exceeds the pool.

With a prefix cache, a sequence admitted with nothing computed first takes the cached blocks of its
longest cached prefix and computes only the rest. At least its last token is always computed (the
step needs its logits), so a hit never covers the block that holds it: the blocks a sequence writes
are always its own, and a shared block is never written (no copy-on-write is needed).

Policy `lpm` (SGLang's longest prefix match) admits, among the waiting sequences, those with the longest
cached prefix first: their prefill is short, and the blocks they would reuse are not evicted meanwhile.
Sequences being recomputed after a preemption keep their place at the front, a sequence passed over
STARVATION_LIMIT times is served next regardless, and FCFS applies when the cache is off or more than
LPM_MAX_QUEUE sequences wait (ranking them every step would cost more than it saves).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ridge.engine.sequence import Sequence, Status
from ridge.kv.block_pool import BlockPool
from ridge.kv.prefix_cache import chain_key

POLICIES = ("fcfs", "lpm")
STARVATION_LIMIT = 64  # steps a waiting sequence may see later arrivals admitted before it
LPM_MAX_QUEUE = 128


@dataclass
class ScheduledStep:
    """Sequences and their token counts this step, decodes first (the attention backend relies on it)."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int
    num_preempted: int = 0

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0
        self.cache = pool.cache

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted = 0

        # Running sequences: decodes before prefill chunks, oldest first within each.
        order = [s for s in self.running if s.num_pending == 1] + [s for s in self.running if s.num_pending > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_pending + len(seq.draft_ids), budget)
            del seq.draft_ids[max(n - seq.num_pending, 0):]  # drafts beyond the budget are dropped
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                # a decode with drafts to check is a multi-token chunk over its cached context
                (decodes if n == 1 and seq.num_pending == 1 else prefills).append((seq, n))
                budget -= n

        # New (or preempted) sequences, in queue order; none are admitted in a step that preempted.
        if self.policy == "lpm" and self.cache is not None and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            self._rank_waiting()
        admitted_up_to = -1  # the latest arrival admitted this step
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed == 0 and self.cache is not None:
                self._take_cached_prefix(seq)
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n):
                if seq.block_table:  # give the cached blocks back; it tries again next step
                    self._release(seq)
                    seq.num_computed = seq.num_registered = 0
                break
            self.waiting.popleft()
            admitted_up_to = max(admitted_up_to, seq.seq_id)
            seq.status = Status.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.perf_counter()
                if self.cache is not None:  # a first admission: count the prompt's lookup once
                    seq.num_cached_tokens = seq.num_computed
                    self.cache.stats.queries += len(seq.token_ids)
                    self.cache.stats.hits += seq.num_computed
            self.running.append(seq)
            (decodes if seq.num_pending == 1 else prefills).append((seq, n))
            budget -= n

        for seq in self.waiting:  # earlier arrivals passed over by a later one (lpm only reorders)
            if seq.seq_id < admitted_up_to:
                seq.times_passed += 1

        chosen = decodes + prefills
        self.num_preemptions += preempted
        return ScheduledStep(
            seqs=[s for s, _ in chosen],
            num_tokens=[n for _, n in chosen],
            num_decodes=len(decodes),
            num_preempted=preempted,
        )

    def _rank_waiting(self) -> None:
        """Order the queue for lpm: starved and preempted sequences first (in arrival order), then by the
        length of their cached prefix, longest first; ties keep arrival order (the sort is stable)."""
        def rank(seq: Sequence) -> tuple[int, int]:
            if seq.times_passed >= STARVATION_LIMIT or seq.num_preemptions or seq.num_computed:
                return (0, 0)
            usable = (len(seq.token_ids) - 1) // self.pool.block_size
            self._hash_blocks(seq, usable)
            return (1, -len(self.cache.lookup(seq.block_keys[:usable])))

        self.waiting = deque(sorted(self.waiting, key=rank))

    def _take_cached_prefix(self, seq: Sequence) -> None:
        bs = self.pool.block_size
        usable = (len(seq.token_ids) - 1) // bs  # full blocks before the one holding the last token
        self._hash_blocks(seq, usable)
        hit = self.cache.lookup(seq.block_keys[:usable])
        self.pool.share(hit)
        seq.block_table = hit
        seq.num_computed = len(hit) * bs
        seq.num_registered = len(hit)

    def _hash_blocks(self, seq: Sequence, count: int) -> None:
        """Extend seq.block_keys to its first `count` full blocks."""
        bs = self.pool.block_size
        for i in range(len(seq.block_keys), count):
            parent = seq.block_keys[i - 1] if i else None
            seq.block_keys.append(chain_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.params.cache_salt))

    def advance(self, seq: Sequence, n: int) -> None:
        """seq's step computed n more tokens; blocks that are now full go into the prefix cache."""
        seq.num_computed += n
        if self.cache is None:
            return
        full = seq.num_computed // self.pool.block_size
        if full > seq.num_registered:
            self._hash_blocks(seq, full)
            for i in range(seq.num_registered, full):
                self.cache.insert(seq.block_keys[i], seq.block_table[i])
            seq.num_registered = full

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Grow seq's block table to hold n more tokens; False (and nothing taken) if the pool is short."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and requeue it at the front; its tokens so far will be recomputed."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.num_registered = 0
        seq.draft_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past seq's tokens (reserved for drafts that were rejected): they hold no
        registered K/V, so nothing in them is lost."""
        keep = self.pool.blocks_for(len(seq.token_ids))
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End seq wherever it is (running, waiting) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.timings.finished = time.perf_counter()

    def check_integrity(self) -> None:
        live = [s.block_table for s in self.running] + [s.block_table for s in self.waiting]
        self.pool.check_integrity(live)
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"
