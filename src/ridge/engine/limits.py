"""RequestLimits: what a request may ask of an engine, checked once where the request arrives."""

from __future__ import annotations

from dataclasses import dataclass

from ridge.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """An engine's limits, small enough to send to the server's process, which checks requests before
    they reach the engine (the engine checks them again only when called directly)."""

    max_model_len: int
    vocab_size: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 embed: bool = False) -> None:
        """Raise ValueError, naming the field and the limit, for a request the engine cannot serve; embed: the
        prompt is embedded, not continued (it may fill the context)."""
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty (0 tokens)")
        if embed and len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens is more than the maximum context length, "
                             f"{self.max_model_len} tokens")
        if not embed and len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leaves no room to generate; the maximum context "
                f"length is {self.max_model_len} tokens (prompt + at least 1 new token)"
            )
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if params is None:
            return
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k: {params.top_k} is more than the vocabulary's {vocab} tokens; -1 or 0 means all")
