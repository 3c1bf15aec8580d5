"""SamplingParams: vLLM's names and defaults, each field checked against its limit on construction.

Numbers are checked for their type too (a bool is not an int) and floats for being finite: the step
computes in float32, where a request's 1e308 or Infinity would turn into NaNs inside the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0  # past this a float32 softmax over logits of a few tens is uniform to the last bit
PENALTY_RANGE = (0.01, 100.0)  # repetition_penalty: a factor on logits; outside it, float32 logits overflow
SEED_RANGE = (-(2**63), 2**63 - 1)  # sample i is seeded with seed + i: within torch.Generator's [-2**63, 2**64)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of a JSON schema (a dict, or its text), any JSON object, a regex
    (matched whole), one of some strings, a grammar (llguidance's Lark, or GBNF / EBNF with `::=` rules), or a
    structural tag (free text where each trigger opens a tag whose content follows its JSON schema: vLLM's JSON text
    of {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}).
    vLLM's names; checked against the tokenizer when the request is added (engine/structured.py)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, choice, grammar, "
                             "structural_tag; got " + (", ".join(given) or "none"))
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json: must be a JSON schema (an object, or its JSON text)")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                    if getattr(self, name) is not None)


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
    prompt_logprobs: int | None = None  # top-n alternatives per prompt token (the prompt's own always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled (stop tokens included)
    bad_words: list[str] | None = None  # never generated: a word's last token is banned where the rest precedes it
    cache_salt: str | None = None  # requests share cached prefixes only with requests of the same salt
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this (a grammar's mask)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        def number(name: str, lo: float, hi: float, limit: str) -> None:
            value = getattr(self, name)
            need(_is_real(value) and math.isfinite(value) and lo <= value <= hi, name, limit)

        need(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        number("temperature", 0.0, MAX_TEMPERATURE, f"a number in [0, {MAX_TEMPERATURE:g}] (0: greedy)")
        number("top_p", 0.0, 1.0, "a number in (0, 1]")
        need(self.top_p > 0, "top_p", "a number in (0, 1]")
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), "top_k",
             "an integer: -1, 0 (off) or >= 1")
        number("min_p", 0.0, 1.0, "a number in [0, 1]")
        lo, hi = PENALTY_RANGE
        number("repetition_penalty", lo, hi, f"a number in [{lo:g}, {hi:g}] (1: off)")
        number("presence_penalty", -2.0, 2.0, "a number in [-2, 2]")
        number("frequency_penalty", -2.0, 2.0, "a number in [-2, 2]")
        need(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]), "seed",
             "an integer in [-2**63, 2**63 - 1] or None")
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"an integer in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        need(self.stop_token_ids is None or all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "a list of token ids >= 0")
        need(self.logit_bias is None or all(_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100
                                            for t, b in self.logit_bias.items()),
             "logit_bias", "a map of token ids >= 0 to biases in [-100, 100]")
        need(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids", "a non-empty list of token ids >= 0")
        need(self.bad_words is None or (isinstance(self.bad_words, list)
                                        and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             "bad_words", "a list of non-blank strings")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""), "cache_salt",
             "a non-empty string or None")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "a StructuredOutputsParams or None")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens: not supported with structured_outputs (the grammar decides where the output "
                             "may end)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), "stop", "non-empty strings")
        self.stop_strings = tuple(stops)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
