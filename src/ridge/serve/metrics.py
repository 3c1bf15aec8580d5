"""Prometheus metrics with vLLM's names under the `ridge:` prefix, updated from each step's report.

Each server owns its registry (no process-global state), so tests can run several side by side.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ridge.engine.engine_core import StepReport
from ridge.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"ridge:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"ridge:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"ridge:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (recomputation included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.cache_evictions = counter("prefix_cache_evictions", "Cached KV blocks evicted to make room.")
        self.cache_hit_rate = gauge("prefix_cache_hit_rate", "Hits over queries since the server started.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of a sequence's drafted tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed by the drafter.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.")
        self.spec_acceptance = gauge("spec_decode_draft_acceptance_rate",
                                     "Accepted over drafted tokens since the server started.")
        self.spec_mean_length = gauge("spec_decode_mean_accepted_length",
                                      "Tokens emitted per verification (accepted drafts + 1) since the start.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a sequence.",
                             LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.output_len = histogram("request_generation_tokens", "Tokens generated per finished request.",
                                    TOKEN_BUCKETS)
        # vLLM's: an info gauge (its value the time) whose labels name the adapters in use
        self.lora_info = Gauge("ridge:lora_requests_info", "LoRA adapters of the running and waiting requests.",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry)
        self._model = model_name
        self._queries = self._hits = 0
        self._spec = [0, 0, 0]  # drafts, drafted tokens, accepted tokens
        self._last_token: dict[tuple[str, int], float] = {}  # (request, sample) -> when its last token came

    def observe_step(self, report: StepReport, finished: list[RequestOutput]) -> None:
        """Called with every step's report from the engine core and the whole outputs of the requests that
        finished with it (stop strings, found in the server's process, included)."""
        m = self._model
        now = report.time
        self.running.labels(m).set(report.num_running)
        self.waiting.labels(m).set(report.num_waiting)
        self.kv_usage.labels(m).set(1 - report.num_free_blocks / report.num_blocks)
        stats = report.stats
        self.prompt_tokens.labels(m).inc(stats.prefill_tokens)
        self.generation_tokens.labels(m).inc(stats.sampled_tokens)
        self.preemptions.labels(m).inc(stats.preemptions)
        self.cache_queries.labels(m).inc(stats.prefix_cache_queries)
        self.cache_hits.labels(m).inc(stats.prefix_cache_hits)
        self.cache_evictions.labels(m).inc(stats.prefix_cache_evictions)
        if stats.spec_drafts:
            self.spec_drafts.labels(m).inc(stats.spec_drafts)
            self.spec_draft_tokens.labels(m).inc(stats.spec_draft_tokens)
            self.spec_accepted_tokens.labels(m).inc(stats.spec_accepted_tokens)
            self._spec = [a + b for a, b in zip(self._spec, (stats.spec_drafts, stats.spec_draft_tokens,
                                                             stats.spec_accepted_tokens), strict=True)]
            drafts, drafted, accepted = self._spec
            self.spec_acceptance.labels(m).set(accepted / drafted)
            self.spec_mean_length.labels(m).set(1 + accepted / drafts)
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        if self._queries:
            self.cache_hit_rate.labels(m).set(self._hits / self._queries)
        if report.adapters is not None:
            use = report.adapters
            self.lora_info.clear()  # one series: the adapters in use now
            self.lora_info.labels(str(use.max_loras), ",".join(use.running), ",".join(use.waiting)).set(time.time())
        for delta in report.requests:  # token arrival, as the engine produced them
            for sample in delta.samples:
                key = (delta.request_id, sample.index)
                if sample.token_ids:
                    last = self._last_token.get(key)
                    if last is None:
                        if delta.metrics.get("ttft_s") is not None and sample.index == 0:
                            self.ttft.labels(m).observe(delta.metrics["ttft_s"])
                    else:
                        self.itl.labels(m).observe((now - last) / len(sample.token_ids))
                    self._last_token[key] = now
                if delta.finished:
                    self._last_token.pop(key, None)
        for out in finished:
            self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        m = self._model
        for c in out.outputs:
            self.success.labels(m, c.finish_reason or "abort").inc()
        for name, histogram in (("e2e_s", self.e2e), ("queue_s", self.queue)):
            if out.metrics.get(name) is not None:
                histogram.labels(m).observe(out.metrics[name])
        self.prompt_len.labels(m).observe(len(out.prompt_token_ids))
        self.output_len.labels(m).observe(sum(len(c.token_ids) for c in out.outputs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
