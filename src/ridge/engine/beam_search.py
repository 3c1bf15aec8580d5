"""Beam search over the engine, one token per round, with the prefix cache doing the forking.

Each round asks the engine for one greedy token of every live beam with its 2 * beam_width most likely
continuations (the log-probabilities of the unmodified logits), keeps the beam_width best candidates
by cumulative log-probability, and starts the next round from them. A beam that forks is just a longer
prompt whose blocks are all in the prefix cache: every child shares its parent's full blocks and
recomputes at most its last, partial block, so beams never copy KV (vLLM's LLM.beam_search works the
same way). A candidate that ends on a stop token is complete and leaves the search; it still takes
one of the beam_width places in that round.

Finished hypotheses are ranked by cumulative_logprob / length ** length_penalty, length counting the
generated tokens (a final stop token excluded), as HF transformers does.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.lora.request import LoRARequest
from ridge.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from ridge.engine.async_engine import AsyncEngine


@dataclass
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0  # > 1 favours longer hypotheses, < 1 shorter ones
    ignore_eos: bool = False
    cache_salt: str | None = None  # beams share blocks only with requests of the same salt

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (a final stop token included)
    cumulative_logprob: float
    finished: bool  # ended on a stop token
    score: float = 0.0
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamHypothesis] = field(default_factory=list)  # best first, beam_width of them


def score(hypothesis: BeamHypothesis, length_penalty: float) -> float:
    length = len(hypothesis.token_ids) - (1 if hypothesis.finished else 0)
    return hypothesis.cumulative_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """The bookkeeping of one search over several prompts, apart from the engine that scores the beams:
    a driver asks next_round() for the token ids to score, runs them with step_params, and hands each
    one's top log-probabilities back to take(), until next_round() has nothing left."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, stop_token_ids: Collection[int],
                 max_model_len: int) -> None:
        self.prompts, self.params, self.max_model_len = prompts, params, max_model_len
        self.stop_token_ids = set(stop_token_ids)
        self.step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * params.beam_width,
                                          ignore_eos=True, cache_salt=params.cache_salt)
        self.live = [[BeamHypothesis([], 0.0, False)] for _ in prompts]
        self.done: list[list[BeamHypothesis]] = [[] for _ in prompts]
        self.rounds = 0
        self._batch: list[tuple[int, BeamHypothesis]] = []

    def next_round(self) -> list[list[int]]:
        """Prompt + tokens of every live beam that still fits the context; [] once the search is over."""
        if self.rounds == self.params.max_tokens:
            return []
        self._batch = [(p, beam) for p, beams in enumerate(self.live) for beam in beams
                       if len(self.prompts[p]) + len(beam.token_ids) < self.max_model_len]
        return [self.prompts[p] + beam.token_ids for p, beam in self._batch]

    def take(self, alternatives: list[dict[int, float]]) -> None:
        """The top log-probabilities of the next token of each sequence next_round() returned, in order."""
        candidates: list[list[BeamHypothesis]] = [[] for _ in self.prompts]
        for (p, beam), options in zip(self._batch, alternatives, strict=True):
            for token, logprob in options.items():
                finished = token in self.stop_token_ids and not self.params.ignore_eos
                candidates[p].append(BeamHypothesis(beam.token_ids + [token], beam.cumulative_logprob + logprob,
                                                    finished))
        for p, pool in enumerate(candidates):
            best = sorted(pool, key=lambda h: h.cumulative_logprob, reverse=True)[:self.params.beam_width]
            self.done[p].extend(h for h in best if h.finished)  # sorted() is stable: ties keep their order
            self.live[p] = [h for h in best if not h.finished]
        self.rounds += 1

    def results(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        results = []
        for p, ids in enumerate(self.prompts):
            hypotheses = self.done[p] + self.live[p]
            for h in hypotheses:
                h.score = score(h, self.params.length_penalty)
                h.text = decode(h.token_ids)
            hypotheses.sort(key=lambda h: h.score, reverse=True)
            results.append(BeamSearchOutput(ids, hypotheses[:self.params.beam_width]))
        return results


def check_engine(config: EngineConfig) -> None:
    """Beam search rescores each hypothesis through the prefix cache every round; an evicting cache would score
    it over a different set of tokens from round to round: refused."""
    if config.eviction is not None:
        raise ValueError(f"kv_eviction: beam search on an engine with kv_eviction={config.kv_eviction!r} is not "
                         "supported; use an engine without eviction")


def beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams,
                lora_request: LoRARequest | None = None, priority: int = 0) -> list[BeamSearchOutput]:
    """Beam search for every prompt at once (with a LoRA adapter: lora_request's; every beam at `priority`); every
    round batches all live beams of all prompts."""
    check_engine(engine.config)
    for ids in prompts:
        engine.validate(ids)
    search = BeamSearch(prompts, params, engine.tokenizer.stop_token_ids, engine.max_model_len)
    while batch := search.next_round():
        order = [engine.add_request(ids, search.step_params, lora_request=lora_request, priority=priority)
                 for ids in batch]
        got: dict[str, dict[int, float]] = {}
        while engine.has_unfinished:
            for delta in engine.step():  # max_tokens=1: the one delta of a request carries its one token
                if delta.finished:
                    got[delta.request_id] = delta.samples[0].logprobs[0]
        search.take([got[i] for i in order])
    return search.results(engine.tokenizer.decode)


async def beam_search_async(engine: AsyncEngine, prompts: list[list[int]], params: BeamSearchParams,
                            request_id: str, lora_request: LoRARequest | None = None, priority: int = 0
                            ) -> list[BeamSearchOutput]:
    """The same search through the server's engine client; a round's beams run as concurrent requests, and
    cancelling the search (a client gone) aborts them all."""
    check_engine(engine.config)
    for ids in prompts:
        engine.validate(ids, SamplingParams())
    search = BeamSearch(prompts, params, engine.tokenizer.stop_token_ids, engine.max_model_len)

    async def next_token(ids: list[int], beam_id: str) -> dict[int, float]:
        final = None
        async for out in engine.generate(ids, search.step_params, beam_id, lora_request=lora_request,
                                         priority=priority):
            final = out
        return final.outputs[0].logprobs[0]

    while batch := search.next_round():
        engine.check_admission(len(batch))
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the round's other beams
                tasks = [group.create_task(next_token(ids, f"{request_id}-r{search.rounds}-{j}"))
                         for j, ids in enumerate(batch)]
        except ExceptionGroup as failed:  # the caller handles the engine's errors one by one
            raise failed.exceptions[0] from None
        search.take([t.result() for t in tasks])
    return search.results(engine.tokenizer.decode)
