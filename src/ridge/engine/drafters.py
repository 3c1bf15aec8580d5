"""Drafters for speculative decoding: propose up to k next tokens for each of a batch of sequences.

Two kinds, one interface: n-gram prompt lookup (no model) and a small draft model that shares the
target's tokenizer. Drafting heads (Medusa, EAGLE, MTP) would be a third: they need the target's hidden
states, which the runner does not hand out yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ridge.engine.runner import ModelRunner
from ridge.engine.sampler import Sampler
from ridge.engine.scheduler import ScheduledStep
from ridge.engine.sequence import Sequence
from ridge.kv.manager import KVManager


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V], the drafter's distribution at each; None = deterministic


class Drafter(ABC):
    def catch_up(self, seqs: list[Sequence]) -> None:  # noqa: B027 - only drafters with state need it
        """Bring the drafter's own state up to the sequences' tokens before drafting (a draft model computes
        a new prompt's K/V here): kept apart from propose() so the policy can time drafting on its own."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[i] tokens to follow seqs[i] (fewer, or none, where it has no good guess)."""

    def release_finished(self) -> None:  # noqa: B027 - only drafters with state need it
        """Free what is held for sequences that have finished."""

    def check_integrity(self, idle: bool) -> None:  # noqa: B027
        """Assert the drafter's own accounting holds (with no request in flight, it holds nothing)."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n first,
    max_n down to min_n) and propose what followed it. Deterministic: verification treats q as one-hot.
    Wins where the output copies its input (code edits, quoting, summaries); costs ~nothing elsewhere."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(s.token_ids, k), None) for s, k in zip(seqs, num_tokens, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        ids = np.asarray(tokens)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # starts 0 .. len - n - 1
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k]
        return []


@dataclass(eq=False)
class _Shadow:
    target: Sequence  # the target's sequence
    seq: Sequence  # this drafter's copy: its tokens as last seen, its block table, its computed count
    agreed: int = 0  # tokens known to equal the target's (the target's length when last seen)


class DraftModelDrafter(Drafter):
    """A small model with the target's tokenizer, on a paged KV cache of its own.

    Each sequence has a shadow here: its tokens as this drafter last saw them (the target's, then the
    drafts), its own block table, and how many of those tokens have K/V in this cache. Before drafting,
    the shadow catches up with the target: K/V stays valid for the prefix on which the two agree (the
    accepted drafts); the rest (1 or 2 tokens after a verification, the whole prompt the first time, in
    chunks of max_num_batched_tokens) is computed again. Drafting pass i then feeds draft i - 1.
    """

    def __init__(self, runner: ModelRunner, kv: KVManager, sampler: Sampler, max_num_batched_tokens: int) -> None:
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shadows: dict[int, _Shadow] = {}  # by the target's seq_id

    def catch_up(self, seqs: list[Sequence]) -> None:
        shadows = [self._catch_up(seq) for seq in seqs]
        self._prefill([shadow for shadow in shadows if self.kv.reserve(shadow, len(shadow.token_ids))])

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        drafts = {s.seq_id: Draft([], None) for s in seqs}
        active: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            shadow = self._catch_up(seq)
            # a sequence the pool has no room for decodes without a draft this step
            if k > 0 and self.kv.reserve(shadow, len(seq.token_ids) + k - 1):
                active.append((seq, shadow, k))
        self._prefill([shadow for _, shadow, _ in active])  # nothing left to do after catch_up()
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s, _, _ in active}
        for i in range(max((k for _, _, k in active), default=0)):
            batch = [(seq, shadow) for seq, shadow, k in active if k > i]
            batch.sort(key=lambda pair: pair[1].num_pending > 1)  # the runner wants single tokens first
            shadows = [shadow for _, shadow in batch]
            logits, _ = self._run(shadows, [s.num_pending for s in shadows])
            tokens, dists = self._sample(logits, [seq for seq, _ in batch])
            for (seq, shadow), token, dist in zip(batch, tokens, dists, strict=True):
                shadow.token_ids.append(token)
                drafts[seq.seq_id].tokens.append(token)
                if dist is not None:
                    probs[seq.seq_id].append(dist)
        for seq_id, rows in probs.items():
            if rows:
                drafts[seq_id].probs = torch.stack(rows)
        return [drafts[s.seq_id] for s in seqs]

    def _prefill(self, shadows: list[Sequence]) -> None:
        """Compute all but the last 2 pending tokens of each shadow, in chunks under the token budget (so
        that the drafting passes stay small even when a long prompt is new here)."""
        while behind := [s for s in shadows if s.num_pending > 2]:
            chosen, counts, budget = [], [], self.max_num_batched_tokens
            for shadow in behind:
                n = min(shadow.num_pending - 2, budget)
                if n <= 0:
                    break
                chosen.append(shadow)
                counts.append(n)
                budget -= n
            self._run(chosen, counts)

    def _run(self, shadows: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, list[Sequence]]:
        step = ScheduledStep(shadows, counts, num_decodes=sum(n == 1 for n in counts))
        out = self.runner.execute(step)
        for shadow, n in zip(shadows, counts, strict=True):
            self.kv.commit(shadow, n)
        return out.logits, out.samplers

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """The drafter's token for each row, and the distribution it was drawn from (None when greedy)."""
        tokens = logits.argmax(dim=-1).tolist()
        dists: list[torch.Tensor | None] = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = self.sampler.probabilities(logits[sampled], [seqs[i] for i in sampled])
            for row, i in enumerate(sampled):
                dists[i] = probs[row]
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=seqs[i].generator))
        return tokens, dists

    def _catch_up(self, seq: Sequence) -> Sequence:
        if seq.seq_id not in self.shadows:
            copy = Sequence(seq_id=seq.seq_id, request_id=seq.request_id, index=seq.index,
                            prompt_len=seq.prompt_len, token_ids=[], params=seq.params)
            self.shadows[seq.seq_id] = _Shadow(seq, copy)
        shadow = self.shadows[seq.seq_id]
        mine, theirs = shadow.seq.token_ids, seq.token_ids
        # the target's tokens only grow, so the first `agreed` still match; compare the drafts after them
        end = min(len(mine), len(theirs))
        agree = next((i for i in range(shadow.agreed, end) if mine[i] != theirs[i]), end)
        self.kv.rewind(shadow.seq, min(agree, len(theirs) - 1))  # the last feeds pass 1
        shadow.seq.token_ids = list(theirs)
        shadow.agreed = len(theirs)
        return shadow.seq

    def release_finished(self) -> None:
        for seq_id, shadow in list(self.shadows.items()):
            if shadow.target.finished:
                self.kv.free(shadow.seq)
                del self.shadows[seq_id]

    def check_integrity(self, idle: bool) -> None:
        self.kv.check_integrity(shadow.seq for shadow in self.shadows.values())
        if idle:
            assert not self.shadows, "the drafter holds sequences with no request in flight"
            self.kv.check_idle()
