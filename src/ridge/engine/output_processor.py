"""Engine deltas -> RequestOutputs with text: detokenization, stop strings and stream hold-back, once.

`LLM` (in-process) and the server (in its own process, beside the HTTP work) both run the engine's
deltas through here, so the step loop never decodes text. A sample that meets a stop string is finished
here at once and cut exactly where the stop ends (its token ids end with the token that completed it);
the caller then aborts that sample in the engine, and any tokens it produced meanwhile are dropped.

A stream (OutputKind.DELTA) gets each step's new text, holding back the characters that could still
become a stop string until they cannot (or the sample ends); FINAL gets the whole output once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ridge.engine.outputs import CompletionOutput, OutputKind, RequestDelta, RequestOutput, SampleDelta
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import OutputText, RidgeTokenizer


@dataclass
class _Sample:
    index: int
    text: OutputText
    hold: int  # characters a stream holds back: a stop string's length - 1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_chars: int = 0  # what a stream has handed out so far
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def whole(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs,
            self.cumulative_logprob if self.logprobs is not None else None,
        )

    def news(self) -> CompletionOutput | None:
        """What a stream has not handed out yet, or None when there is nothing new."""
        text = self.text.text
        end = len(text) if self.finished else max(self.sent_chars, len(text) - self.hold)
        if end == self.sent_chars and self.sent_tokens == len(self.token_ids) and self.finished == self.sent_finish:
            return None
        start_chars, start_tokens = self.sent_chars, self.sent_tokens
        self.sent_chars, self.sent_tokens, self.sent_finish = end, len(self.token_ids), self.finished
        return CompletionOutput(
            self.index, text[start_chars:end], self.token_ids[start_tokens:], self.finish_reason, self.stop_reason,
            self.logprobs[start_tokens:] if self.logprobs is not None else None,
            self.cumulative_logprob if self.logprobs is not None else None,
        )


class RequestTracker:
    """One request's outputs as the engine's deltas arrive."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: RidgeTokenizer, kind: OutputKind = OutputKind.FINAL,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.kind = kind
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.started = False  # a first token has arrived (until then the request counts as waiting)
        hold = max((len(s) - 1 for s in params.stop_strings), default=0)
        self._samples = [_Sample(i, OutputText(tokenizer, params), hold,
                                 logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self._metrics: dict[str, float | None] = {}
        self._num_cached_tokens = 0
        self._prompt_logprobs: list[dict[int, float] | None] | None = None
        self._prompt_logprobs_sent = False  # a stream hands them out once
        self._embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self._samples)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self._samples)

    def apply(self, delta: RequestDelta) -> tuple[RequestOutput | None, list[int]]:
        """Take one step's delta; return the output to hand out now (None: nothing for this kind yet) and
        the samples that a stop string just finished (the engine must abort them)."""
        stopped = [d.index for d in delta.samples if self._extend(self._samples[d.index], d)]
        self.started = self.started or any(s.token_ids for s in self._samples)
        self._metrics = dict(delta.metrics)
        self._num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self._embedding = delta.embedding
        if self.finished and not delta.finished:  # finished here, by stop strings: the engine's clock never stopped
            self._metrics["e2e_s"] = time.perf_counter() - self.arrival_time
        return self.output(), stopped

    def output(self) -> RequestOutput | None:
        """What this request's kind hands out now: its whole output once finished, or a stream's news."""
        if self.kind is OutputKind.FINAL:
            return self.whole_output() if self.finished else None
        completions = [c for s in self._samples if (c := s.news()) is not None]
        news_of_prompt = self._prompt_logprobs is not None and not self._prompt_logprobs_sent
        if not completions and not self.finished and not news_of_prompt:
            return None
        self._prompt_logprobs_sent = self._prompt_logprobs is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, completions, self.finished,
                             self._metrics, self._num_cached_tokens,
                             self._prompt_logprobs if news_of_prompt else None)

    def whole_output(self) -> RequestOutput:
        """Every sample's whole output so far (its lists, not copies: take it once the request is done)."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [s.whole() for s in self._samples],
                             self.finished, self._metrics, self._num_cached_tokens, self._prompt_logprobs,
                             self._embedding)

    def _extend(self, sample: _Sample, delta: SampleDelta) -> bool:
        """Append delta's tokens to sample; True when a stop string finished it."""
        if sample.finished:  # finished here already; these tokens came after the stop
            return False
        # A stop token ends the sample without entering its text.
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


class OutputProcessor:
    """The trackers of an in-process engine's requests: deltas in, outputs and stop-string aborts out."""

    def __init__(self, tokenizer: RidgeTokenizer) -> None:
        self.tokenizer = tokenizer
        self.trackers: dict[str, RequestTracker] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            kind: OutputKind = OutputKind.FINAL) -> None:
        self.trackers[request_id] = RequestTracker(request_id, prompt, prompt_ids, params, self.tokenizer, kind)

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """The outputs these deltas make, and the (request, sample) pairs a stop string finished. A request
        leaves once its output is final; deltas of requests not (or no longer) tracked are ignored."""
        outputs, stopped = [], []
        for delta in deltas:
            tracker = self.trackers.get(delta.request_id)
            if tracker is None:
                continue
            output, stops = tracker.apply(delta)
            stopped.extend((delta.request_id, index) for index in stops)
            if output is not None:
                outputs.append(output)
            if tracker.finished:
                del self.trackers[delta.request_id]
        return outputs, stopped
