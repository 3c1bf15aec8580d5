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

from dataclasses import dataclass, field

from ridge.engine.engine import LLMEngine
from ridge.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0  # > 1 favours longer hypotheses, < 1 shorter ones
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


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


def beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for every prompt at once; every round batches all live beams of all prompts."""
    for ids in prompts:
        engine.validate(ids)
    stop_ids = engine.tokenizer.stop_token_ids
    width = params.beam_width
    step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    live = [[BeamHypothesis([], 0.0, False)] for _ in prompts]
    done: list[list[BeamHypothesis]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        batch = [(p, beam) for p, beams in enumerate(live) for beam in beams
                 if len(prompts[p]) + len(beam.token_ids) < engine.max_model_len]
        if not batch:
            break
        outputs = _run(engine, [prompts[p] + beam.token_ids for p, beam in batch], step_params)
        candidates: list[list[BeamHypothesis]] = [[] for _ in prompts]
        for (p, beam), alternatives in zip(batch, outputs, strict=True):
            for token, logprob in alternatives.items():
                finished = token in stop_ids and not params.ignore_eos
                candidates[p].append(BeamHypothesis(beam.token_ids + [token], beam.cumulative_logprob + logprob,
                                                    finished))
        for p, pool in enumerate(candidates):
            best = sorted(pool, key=lambda h: h.cumulative_logprob, reverse=True)[:width]  # stable: ties keep order
            done[p].extend(h for h in best if h.finished)
            live[p] = [h for h in best if not h.finished]
    results = []
    for p, ids in enumerate(prompts):
        hypotheses = done[p] + live[p]
        for h in hypotheses:
            h.score = score(h, params.length_penalty)
            h.text = engine.tokenizer.decode(h.token_ids)
        hypotheses.sort(key=lambda h: h.score, reverse=True)
        results.append(BeamSearchOutput(ids, hypotheses[:width]))
    return results


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[dict[int, float]]:
    """The top-2W log-probabilities of each prompt's next token."""
    order = [engine.add_request(ids, params) for ids in prompts]
    got: dict[str, dict[int, float]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].logprobs[0]
    return [got[i] for i in order]
