"""Who runs this step: continuous batching under a token budget, chunked prefill, recompute preemption.

Each step fills `max_num_batched_tokens`: running decodes first (one token each), then the prompt
chunks of running sequences that are still prefilling, then new sequences from the waiting queue,
whose long prompts are cut to whatever budget is left. When KV blocks run out, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to recompute
its tokens later. The oldest sequence therefore always progresses, so nothing stalls forever:
a single sequence always fits, because max_model_len never exceeds the pool.

A preempted sequence is readmitted only when the free blocks hold all its tokens (as it will hold them, windows
counted), or when nothing else runs: readmitted as soon as its next chunk fits, it would prefill beside the
sequence that preempted it until that one grows into its blocks again, and recompute its prompt each round.

Block tables belong to the KV manager (kv/manager.py): the scheduler asks it for room and for cached
prefixes, and never touches a table itself. After the model ran, update() finishes the step: it tells
the manager what was computed, appends the sampled tokens, checks token stops and settles drafts.

A request's n > 1 samples with a prefix cache: samples 1.. are held back until sample 0 has sampled
its first token (its prompt is then in the cache), so they find every full prompt block cached and
compute only the last, partial one.

A model with state-space layers and prefix caching: a prefill chunk ends where its sequence leaves a snapshot of
its state (kv/state_snapshots.py), so a prompt may take one step more.

Policy `lpm` (SGLang's longest prefix match) admits, among the waiting sequences, those with the longest
cached prefix first: their prefill is short, and the blocks they would reuse are not evicted meanwhile.
Sequences being recomputed after a preemption keep their place at the front, a sequence passed over
STARVATION_LIMIT times is served next regardless, and FCFS applies when the cache is off or more than
LPM_MAX_QUEUE sequences wait (ranking them every step would cost more than it saves).

Policy `priority` (vLLM's): each request carries a priority, lower first. The queue is ordered by (priority,
arrival); when blocks run out the least important running sequence (the latest arrival among the largest priority
value) is preempted rather than the newest; and a waiting sequence that finds no room (blocks, or max_num_seqs)
preempts running ones of a larger priority value until it fits. The most important sequence therefore always
progresses; equal priorities are served as fcfs serves them, and a less important request waits as long as more
important ones keep coming (vLLM's rule too: there is no aging).

With whole_prompts (a pooling runner that reads every token of a prompt: mean or CLS pooling, or an encoder, whose
tokens attend to the later ones too), a prompt is admitted only where the step's budget holds all of it, and is
never chunked; the engine keeps such prompts within max_num_batched_tokens and runs no prefix cache for them.

With LoRA adapters, the running sequences use at most max_loras adapters between them (vLLM's rule): a waiting
sequence of one more adapter is passed over, keeping its place, and later arrivals may go first.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ridge.config import SCHEDULE_POLICIES
from ridge.engine.sequence import Sequence, Status
from ridge.kv.manager import KVManager

STARVATION_LIMIT = 64  # steps a waiting sequence may see later arrivals admitted before it
LPM_MAX_QUEUE = 128


def check_priority(policy: str, priority: int) -> None:
    """Refuse a priority the policy would not honour (all requests are equal under fcfs and lpm)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority: {priority} asked for, but this engine schedules by {policy}; start it with "
                         "--schedule-policy priority to order requests by priority")


def importance(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order, most important first: priority, then arrival."""
    return seq.priority, seq.seq_id


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


@dataclass
class Sampled:
    """What a step produced for one sequence that computed its last token: its next token, or, after
    verifying drafts, the accepted drafts and the target's next token (logprobs only when asked)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class StopRule:
    """When a sampled token ends a sequence (stop strings are the output processor's: they need text)."""

    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_model_len: int | None = None

    def check(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if seq ends with `token`, its newest token; else None."""
        params = seq.params
        if seq.num_outputs >= params.min_tokens and (
                token in (params.stop_token_ids or ()) or (not params.ignore_eos and token in self.eos_token_ids)):
            return "stop", token
        if seq.grammar is not None and seq.grammar.failed:
            return "error", None
        if seq.grammar is not None and token in self.eos_token_ids and seq.grammar.stopped:
            return "stop", token  # a complete grammar allows only the end (with ignore_eos too: nothing else follows)
        if seq.num_outputs >= params.max_tokens or (
                self.max_model_len is not None and len(seq.token_ids) >= self.max_model_len):
            return "length", None
        return None


class Scheduler:
    def __init__(self, kv: KVManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "fcfs", stops: StopRule = StopRule(), max_loras: int | None = None,
                 whole_prompts: bool = False) -> None:
        """max_loras: the LoRA adapters the running sequences may use between them (None: no adapters);
        whole_prompts: every prompt computed in one chunk (see the module's note)."""
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy: {policy!r} is not one of {', '.join(SCHEDULE_POLICIES)}")
        self.policy = policy
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.stops = stops
        self.max_loras = max_loras
        self.whole_prompts = whole_prompts
        self.held: dict[int, list[Sequence]] = {}  # a request's first sample's seq_id -> its held siblings
        self.num_preemptions = 0
        self.cache = kv.cache

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples (see the module's note on holding siblings back)."""
        first, siblings = seqs[0], seqs[1:]
        if siblings and self.cache is not None and len(first.token_ids) > self.kv.block_size:
            self.held[first.seq_id] = siblings
            siblings = []
        self.waiting.extend([first, *siblings])

    def schedule(self) -> ScheduledStep:
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        budget, preempted = self._schedule_running(self.max_num_batched_tokens, decodes, prefills)
        if not preempted:  # none are admitted in a step that preempted
            preempted += self._admit(budget, decodes, prefills)
        chosen = decodes + prefills
        self.num_preemptions += preempted
        return ScheduledStep(
            seqs=[s for s, _ in chosen],
            num_tokens=[n for _, n in chosen],
            num_decodes=len(decodes),
            num_preempted=preempted,
        )

    def _schedule_running(self, budget: int, decodes: list[tuple[Sequence, int]],
                          prefills: list[tuple[Sequence, int]]) -> tuple[int, int]:
        """Running sequences, decodes before prefill chunks, oldest first within each, preempting the newest
        (under priority: the least important) when blocks run out; returns the budget left and the number
        preempted."""
        preempted = 0
        order = [s for s in self.running if s.num_pending == 1] + [s for s in self.running if s.num_pending > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self.kv.chunk_end(seq, seq.num_computed + min(seq.num_pending + len(seq.draft_ids), budget))
            n -= seq.num_computed
            if n == 0:  # its next tokens attend both ways and are over the budget left: a later step takes them
                continue
            del seq.draft_ids[max(n - seq.num_pending, 0):]  # drafts beyond the budget are dropped
            while not self.kv.reserve(seq, seq.num_computed + n):
                victim = max(self.running, key=importance) if self.policy == "priority" else self.running[-1]
                self._preempt(victim)
                preempted += 1
                budget += self._unschedule(victim, decodes, prefills)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                # a decode with drafts to check is a multi-token chunk over its cached context
                (decodes if n == 1 and seq.num_pending == 1 else prefills).append((seq, n))
                budget -= n
        return budget, preempted

    def _admit(self, budget: int, decodes: list[tuple[Sequence, int]], prefills: list[tuple[Sequence, int]]) -> int:
        """New (or preempted) sequences, in queue order, while the budget, the pool and max_num_seqs allow (under
        priority, room is made by preempting less important running sequences); returns the number preempted."""
        if self.policy == "lpm" and self.cache is not None and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            self._rank_waiting()
        elif self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=importance))
        admitted_up_to = -1  # the latest arrival admitted this step
        adapters = {s.adapter for s in self.running if s.adapter is not None} if self.max_loras else set()
        passed_over: list[Sequence] = []  # of an adapter that would be one too many: they keep their place
        displaced = 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.whole_prompts and seq.num_pending > budget:
                break  # it waits for a step with room for all of it (one always comes: prompts fit the budget)
            if seq.adapter is not None and seq.adapter not in adapters and len(adapters) == self.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            room = len(self.running) < self.max_num_seqs and not (seq.num_preemptions and self.running and (
                self.kv.num_free < self.kv.blocks_to_hold(len(seq.token_ids), self.max_num_batched_tokens)))
            if room:  # (a preempted sequence's readmission: see the module's note)
                if seq.num_computed == 0:
                    self.kv.take_cached_prefix(seq)
                n = self.kv.chunk_end(seq, seq.num_computed + min(seq.num_pending, budget)) - seq.num_computed
                if n == 0:  # its next tokens attend both ways and are over the budget left: it waits its turn
                    self.kv.free(seq)
                    break
                room = self.kv.reserve(seq, seq.num_computed + n)
                if not room:
                    self.kv.free(seq)  # the cached blocks go back; it tries again (next step, or after a displacement)
            if not room:
                freed = self._displace(seq, decodes, prefills)
                if freed is None:
                    break
                displaced += 1
                budget += freed
                continue
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
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            # (a one-token prompt computed whole is a prompt still: an encoder's attends as a prompt does)
            (decodes if seq.num_pending == 1 and not self.whole_prompts else prefills).append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(passed_over))
        for seq in self.waiting:  # earlier arrivals passed over by a later one (lpm only reorders)
            if seq.seq_id < admitted_up_to:
                seq.times_passed += 1
        return displaced

    def _displace(self, seq: Sequence, decodes: list[tuple[Sequence, int]],
                  prefills: list[tuple[Sequence, int]]) -> int | None:
        """Under priority, preempt the least important running sequence where it is less important than the waiting
        `seq` (a larger priority value); return the step's budget it gave back, or None where there is none."""
        if self.policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=importance)
        if victim.priority <= seq.priority:
            return None
        self._preempt(victim)
        return self._unschedule(victim, decodes, prefills)

    @staticmethod
    def _unschedule(seq: Sequence, decodes: list[tuple[Sequence, int]], prefills: list[tuple[Sequence, int]]) -> int:
        """Take a sequence preempted in this step out of the step, if it was scheduled before; return its tokens."""
        for chosen in (decodes, prefills):
            for i, (s, n) in enumerate(chosen):
                if s is seq:
                    del chosen[i]
                    return n
        return 0

    def _rank_waiting(self) -> None:
        """Order the queue for lpm: starved and preempted sequences first (in arrival order), then by the
        length of their cached prefix, longest first; ties keep arrival order (the sort is stable)."""
        def rank(seq: Sequence) -> tuple[int, int]:
            if seq.times_passed >= STARVATION_LIMIT or seq.num_preemptions or seq.num_computed:
                return (0, 0)
            return (1, -self.kv.cached_prefix_len(seq))

        self.waiting = deque(sorted(self.waiting, key=rank))

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and requeue it at the front (under priority: at its place in the queue's order); its
        tokens so far will be recomputed."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.draft_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        if self.policy == "priority":  # the queue is in order while sequences are admitted (_admit sorts it first)
            keys = [importance(s) for s in self.waiting]
            self.waiting.insert(bisect.bisect(keys, importance(seq)), seq)
        else:
            self.waiting.appendleft(seq)

    # ---- after the model ran -----------------------------------------------------------------------
    def update(self, step: ScheduledStep, sampled: list[Sampled]) -> int:
        """Finish `step`: its K/V computed, tokens appended, token stops checked, drafts settled; return
        the number of tokens appended."""
        for seq, n in zip(step.seqs, step.num_tokens, strict=True):
            self.kv.commit(seq, n - len(seq.draft_ids))  # the drafts' K/V counts once accepted
        now = time.perf_counter()
        appended = 0
        for result in sampled:
            seq = result.seq
            drafted, seq.draft_ids, seq.draft_probs = bool(seq.draft_ids), [], None
            if seq.timings.first_token is None:
                seq.timings.first_token = now
                self._release_held(seq)
            for i, token in enumerate(result.tokens):
                seq.token_ids.append(token)
                appended += 1
                if result.logprobs is not None:
                    seq.logprobs.append(result.logprobs[i])
                    seq.cumulative_logprob += result.logprobs[i][token]
                if (stop := self.stops.check(seq, token)) is not None:
                    self.finish(seq, *stop)
                    break
            if drafted and not seq.finished:
                # after the append: the cache hashes the tokens of full blocks
                self.kv.commit(seq, len(result.tokens) - 1)
                self.kv.trim(seq)
        return appended

    def _release_held(self, first: Sequence) -> None:
        """first's prompt is in the cache now (or first ended): its held siblings go to the front of the queue."""
        for sibling in reversed(self.held.pop(first.seq_id, [])):
            self.waiting.appendleft(sibling)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End seq wherever it is (running, waiting, held) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for siblings in self.held.values():
                if seq in siblings:
                    siblings.remove(seq)
        self._release_held(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.timings.finished = time.perf_counter()

    def check_integrity(self) -> None:
        held = [s for siblings in self.held.values() for s in siblings]
        self.kv.check_integrity(self.running, [*self.waiting, *held])
        assert all(s.status is Status.RUNNING for s in self.running), "a sequence in the running list is not running"
