"""Speculative decoding: exact acceptance of drafted tokens, and when (and how far) to speculate.

A drafter proposes k tokens for a sequence; the target scores them in one forward pass, as k + 1
query rows over the paged cache (row i predicts the token after draft i - 1). verify() then keeps a
prefix of the draft and adds one token of the target's own, so that every step emits 1 to k + 1 tokens
whose distribution is exactly the target's (maximal coupling, Leviathan et al. 2023 / Chen et al. 2023):

  accept draft token x with probability min(1, p(x) / q(x));
  at the first rejection emit a token from normalize(max(p - q, 0)) and stop;
  if all k are accepted, emit a bonus token from p at the last row.

p and q are the target's and the drafter's distributions after the request's own temperature, top-k,
top-p, min-p and logit bias. A deterministic drafter (n-gram lookup) is the q = one-hot case, and at
temperature 0 verification is plain: drafts are kept while they equal the target's argmax.

The policy picks k per step from the break-even model: with a per-token acceptance rate a, one target
pass yields E(k) = (1 - a^(k+1)) / (1 - a) tokens; it costs the target's step over B(k + 1) tokens plus
k drafter passes instead of one plain step over B tokens. Both costs are fitted online from measured
step times, so at a batch large enough for the target's pass to be compute-bound, the model says no.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ridge.sampling_params import SamplingParams


def speculable(params: SamplingParams) -> bool:
    """Requests whose next-token distribution does not depend on the drafts before it: penalties count
    the output so far, logprobs would report the drafter's steps, and bad words move with each token; those
    decode plainly. (A grammar's mask moves too, but its masks for each draft position are computed ahead:
    engine/structured.py.)"""
    return (params.repetition_penalty == 1 and not params.presence_penalty and not params.frequency_penalty
            and params.logprobs is None and not params.bad_words)


def verify(target: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, greedy: bool,
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verification step emits: the accepted prefix of `draft` plus one from the target.

    target: [k + 1, V], the target's processed probabilities (or, when greedy, its logits) at each row;
    draft_probs: [k, V], the drafter's probabilities, or None for a deterministic drafter (one-hot q).
    """
    k = len(draft)
    if greedy:
        best = target.argmax(dim=-1).tolist()
        accepted = next((i for i in range(k) if draft[i] != best[i]), k)
        return draft[:accepted] + [best[accepted]]
    uniforms = torch.rand(k, generator=generator, device=target.device).tolist()
    draft_p = target[torch.arange(k), torch.tensor(draft, dtype=torch.long)].tolist() if k else []
    for i, token in enumerate(draft):
        q = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if uniforms[i] * q < draft_p[i]:  # accept with probability min(1, p / q)
            continue
        if draft_probs is not None:
            residual = (target[i] - draft_probs[i]).clamp_(min=0)
        else:
            residual = target[i].clone()
            residual[token] = 0
        if float(residual.sum()) <= 0:  # p <= q everywhere: only possible when p == q, so p itself
            residual = target[i]
        return draft[:i] + [_draw(residual, generator)]
    return list(draft) + [_draw(target[k], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights.float(), 1, generator=generator))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a target pass yields when each of k drafted tokens is accepted with probability `acceptance`
    independently, plus the target's own: (1 - a^(k+1)) / (1 - a) (Leviathan et al., 2023)."""
    if acceptance >= 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


class LinearCost:
    """seconds ~ fixed + per_unit * units, least squares over the sizes measured so far.

    Each size keeps a moving average of its own measurements, and sizes stay until `max_sizes` newer ones
    push them out: a size measured once (a verification pass, before the policy turned speculation off)
    keeps informing the fit however many steps of another size follow it.
    """

    def __init__(self, max_sizes: int = 32, smoothing: float = 0.3) -> None:
        self.by_size: dict[float, float] = {}  # size -> moving average of its seconds, oldest first
        self.max_sizes, self.smoothing = max_sizes, smoothing

    def add(self, units: float, seconds: float) -> None:
        previous = self.by_size.pop(units, None)
        self.by_size[units] = seconds if previous is None else previous + self.smoothing * (seconds - previous)
        if len(self.by_size) > self.max_sizes:
            del self.by_size[next(iter(self.by_size))]

    @property
    def samples(self) -> list[tuple[float, float]]:
        return list(self.by_size.items())

    @property
    def spread(self) -> float:
        """Largest over smallest measured size: a fit needs sizes at least ~1.5x apart."""
        if not self.by_size:
            return 0.0
        return max(self.by_size) / max(min(self.by_size), 1e-9)

    def mean(self) -> float | None:
        return sum(self.by_size.values()) / len(self.by_size) if self.by_size else None

    def __call__(self, units: float) -> float | None:
        if len(self.by_size) < 2 or self.spread < 1.5:
            return None
        n = len(self.by_size)
        mean_u = sum(self.by_size) / n
        mean_s = sum(self.by_size.values()) / n
        var = sum((u - mean_u) ** 2 for u in self.by_size)
        slope = max(sum((u - mean_u) * (s - mean_s) for u, s in self.by_size.items()) / var, 0.0)
        fixed = max(mean_s - slope * mean_u, 0.0)
        return fixed + slope * units


@dataclass
class SpeculationStats:
    num_drafts: int = 0  # verification steps of one sequence
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpeculationPolicy:
    """k for the next step: fixed, or adaptive from the measured acceptance and costs (see module doc)."""

    num_speculative_tokens: int
    adaptive: bool = True
    explore_every: int = 32  # adaptive: one step in this many does the other thing (see choose())
    explore_above: float = 0.9  # ... speculation only where the predicted speedup is at least this
    cold_start_tokens: int = 64  # before any fit: speculate only where a verification is this many tokens at most
    prior_acceptance: float = 0.6
    target_cost: LinearCost = field(default_factory=LinearCost)  # seconds of a decoding target pass by tokens
    draft_cost: LinearCost = field(default_factory=LinearCost)  # seconds of one drafter pass by batch
    # per-token acceptance, maximum likelihood for the geometric model: accepted / (accepted + rejections)
    accepted: float = 0.0
    rejected: float = 0.0
    steps: int = 0
    last_choice: int = 0
    last_speedup: float | None = None

    @property
    def acceptance(self) -> float:
        trials = self.accepted + self.rejected
        return self.accepted / trials if trials >= 8 else self.prior_acceptance

    def observe_verification(self, drafted: int, accepted: int) -> None:
        decay = 0.995  # forget slowly: the acceptance rate moves with the text being written
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < drafted else 0)

    def predicted_speedup(self, k: int, batch: int) -> float | None:
        """Tokens per second with k drafts over tokens per second without, at this batch size."""
        plain = self.target_cost(batch)
        verify_cost = self.target_cost(batch * (k + 1))
        if plain is None or verify_cost is None:
            return None
        drafting = self.draft_cost(batch)
        if drafting is None:  # batch sizes too alike for a fit: their mean
            drafting = self.draft_cost.mean() or 0.0
        return expected_tokens(self.acceptance, k) * plain / (verify_cost + k * drafting)

    def choose(self, batch: int) -> int:
        """k for a step in which `batch` sequences decode (0: decode plainly)."""
        self.steps += 1
        k_max = self.num_speculative_tokens
        if not self.adaptive or batch == 0:
            self.last_choice = k_max if batch else 0
            return self.last_choice
        explore = self.steps % self.explore_every == 0
        if explore and self.last_choice:
            self.last_choice = 0  # a plain step now and then keeps the target's cost fit anchored at B tokens
            return 0
        if self.target_cost(batch) is None:  # too few sizes measured for the model
            # measure plain first; then speculation, where verifying k drafts per sequence stays a small step
            small = batch * (k_max + 1) <= self.cold_start_tokens
            self.last_choice = k_max if small and batch in self.target_cost.by_size else 0
            return self.last_choice
        speedups = {k: self.predicted_speedup(k, batch) or 0.0 for k in range(1, k_max + 1)}
        best = max(speedups, key=speedups.__getitem__)
        self.last_speedup = speedups[best]
        if explore and self.last_speedup >= self.explore_above:
            # near break-even, re-measure drafting, verification and acceptance now and then. Not further
            # off: a draft model that sat out T steps first catches up on B * T tokens
            self.last_choice = k_max
            return k_max
        self.last_choice = best if speedups[best] > 1.0 else 0
        return self.last_choice
