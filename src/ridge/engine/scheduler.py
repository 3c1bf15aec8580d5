"""Who runs this step: continuous batching under a token budget, chunked prefill, recompute preemption.

Each step fills `max_num_batched_tokens`: running decodes first (one token each), then the prompt
chunks of running sequences that are still prefilling, then new sequences from the waiting queue,
whose long prompts are cut to whatever budget is left. When KV blocks run out, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to recompute
its tokens later. The oldest sequence therefore always progresses, so nothing stalls forever:
a single sequence always fits, because max_model_len never exceeds the pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ridge.engine.sequence import Sequence, Status
from ridge.kv.block_pool import BlockPool


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
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0

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
            n = min(seq.num_pending, budget)
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                (decodes if seq.num_pending == 1 else prefills).append((seq, n))
                budget -= n

        # New (or preempted) sequences, in queue order; none are admitted in a step that preempted.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.perf_counter()
            self.running.append(seq)
            (decodes if seq.num_pending == 1 else prefills).append((seq, n))
            budget -= n

        chosen = decodes + prefills
        self.num_preemptions += preempted
        return ScheduledStep(
            seqs=[s for s, _ in chosen],
            num_tokens=[n for _, n in chosen],
            num_decodes=len(decodes),
            num_preempted=preempted,
        )

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
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

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
