"""SamplingParams: vLLM's names and defaults, each field checked against its limit on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages any token already in the prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-n alternatives per generated token (the sampled one is always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    cache_salt: str | None = None  # requests share cached prefixes only with requests of the same salt
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        need(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        need(self.temperature >= 0, "temperature", ">= 0")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", "-1, 0 (off) or >= 1")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"in [0, max_tokens={self.max_tokens}]")
        need(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]")
        need(self.logit_bias is None or all(isinstance(t, int) and t >= 0 and -100 <= b <= 100
                                            for t, b in self.logit_bias.items()),
             "logit_bias", "a map of token ids >= 0 to biases in [-100, 100]")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""), "cache_salt",
             "a non-empty string or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), "stop", "non-empty strings")
        self.stop_strings = tuple(stops)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
