"""Token deltas from the engine core -> RequestOutputs with text, in the server's process.

Detokenization and stop strings run here, beside the HTTP work, not in the step loop. A sample that
meets a stop string is finished here at once and cut exactly where the engine itself would cut it
(its token ids end with the token that completed the stop); the engine is then told to abort that
sample, and any tokens it produced meanwhile are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ridge.engine.engine import CompletionOutput, RequestOutput
from ridge.engine.engine_core import RequestDelta, SampleDelta
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import OutputText, RidgeTokenizer


@dataclass
class _Sample:
    index: int
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text.text, list(self.token_ids), self.finish_reason, self.stop_reason,
            list(self.logprobs) if self.logprobs is not None else None,
            self.cumulative_logprob if self.logprobs is not None else None,
        )


class RequestTracker:
    """One request's outputs as the engine's deltas arrive."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: RidgeTokenizer, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival_time = arrival_time
        self.started = False  # a first token has arrived (until then the request counts as waiting)
        self._samples = [_Sample(i, OutputText(tokenizer, params), logprobs=[] if params.logprobs is not None else None)
                         for i in range(params.n)]
        self._metrics: dict[str, float | None] = {}
        self._num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self._samples)

    def apply(self, delta: RequestDelta) -> tuple[RequestOutput, list[int]]:
        """Take one step's delta; return the request's output now and the samples that a stop string
        just finished (the engine must abort them)."""
        stopped = [d.index for d in delta.samples if self._extend(self._samples[d.index], d)]
        self.started = self.started or any(s.token_ids for s in self._samples)
        self._metrics = dict(delta.metrics)
        self._num_cached_tokens = delta.num_cached_tokens
        if self.finished and not delta.finished:  # finished here, by stop strings: the engine's clock never stopped
            self._metrics["e2e_s"] = time.perf_counter() - self.arrival_time
        return self.output(), stopped

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, None, self.prompt_ids, [s.output() for s in self._samples],
                             self.finished, self._metrics, self._num_cached_tokens)

    def _extend(self, sample: _Sample, delta: SampleDelta) -> bool:
        """Append delta's tokens to sample; True when a stop string finished it."""
        if sample.finish_reason is not None:  # finished here already; these tokens came after the stop
            return False
        # A stop token ends the sample without entering its text, as in the engine's own detokenization.
        ends_on_stop_token = delta.finish_reason == "stop" and isinstance(delta.stop_reason, int)
        last = len(delta.token_ids) - 1
        for k, token in enumerate(delta.token_ids):
            sample.token_ids.append(token)
            if sample.logprobs is not None and delta.logprobs is not None:
                sample.logprobs.append(delta.logprobs[k])
                sample.cumulative_logprob += delta.logprobs[k][token]
            if k == last and ends_on_stop_token:
                break
            stop = sample.text.add(token, len(sample.token_ids))
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return True
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        return False
