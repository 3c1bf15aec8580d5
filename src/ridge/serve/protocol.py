"""OpenAI request bodies (with vLLM's extra sampling fields) and the error every endpoint raises.

Field limits live in SamplingParams; this module only maps names (max_completion_tokens, top_logprobs,
logit_bias keyed by strings) and reports a bad field as a RequestError naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ridge.engine.beam_search import BeamSearchParams
from ridge.sampling_params import SamplingParams


class RequestError(Exception):
    """An error the client caused (or may retry), rendered as OpenAI's envelope with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "BadRequestError") -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    use_beam_search: bool = False
    beam_width: int | None = None  # default: n, the number of beams returned
    length_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError as exc:
                raise RequestError(f"logit_bias: keys must be token ids, got {exc}", "logit_bias") from exc
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                min_tokens=self.min_tokens, logprobs=logprobs, logit_bias=bias,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            )
        except ValueError as exc:  # SamplingParams messages start with the field's name
            raise RequestError(str(exc), str(exc).split()[0].rstrip(":")) from exc

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """With use_beam_search, the search's settings (params are the already checked sampling fields);
        fields a beam search does not honour are refused rather than ignored."""
        if not self.use_beam_search:
            return None
        width = self.beam_width if self.beam_width is not None else params.n
        if params.n > width:
            raise RequestError(f"n: {params.n} beams asked for, but beam_width is {width}; n must be at most "
                               "beam_width", "n")
        for name, unsupported in (("stop", params.stop_strings), ("logprobs", params.logprobs is not None)):
            if unsupported:
                raise RequestError(f"{name}: not supported with use_beam_search", name)
        try:
            return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens,
                                    length_penalty=self.length_penalty, ignore_eos=params.ignore_eos,
                                    cache_salt=params.cache_salt)
        except ValueError as exc:  # BeamSearchParams messages start with the field's name
            raise RequestError(str(exc), str(exc).split()[0]) from exc

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens



def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; content given as parts keeps its text parts."""
    out = []
    for m in messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            message["content"] = "".join(p.get("text", "") for p in m.content if p.get("type") == "text")
        out.append(message)
    return out


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
