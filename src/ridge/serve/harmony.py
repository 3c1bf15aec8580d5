"""gpt-oss's replies in OpenAI's harmony format, read off their token ids: the thinking, the answer, the tool calls.

A harmony reply is a run of messages, each a header and a body:
    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY
closed by <|end|> (another message follows), <|return|> (the answer is done) or <|call|> (a tool is called; the
model waits for its result). The chat template ends the prompt with `<|start|>assistant`, so a reply opens in its
first message's header. The channels: `analysis`, the chain of thought (the chat message's reasoning_content);
`final`, the answer (content); `commentary`, a tool call where the header names a recipient (`functions.NAME`, the
body its JSON arguments), else a preamble the user sees (content).

The markers are special tokens, which decoding skips: the reply's text (what /v1/completions returns) has lost the
structure, so a chat reply is read here from its token ids, each message's body decoded on its own. A reply that
never opens a body (no <|message|>: not harmony at all) is returned whole as content, never dropped; so is a call
cut off before it closed.

A structured-output constraint (response_format, structured_outputs, guided_*) holds the final channel's message:
the reply may think first (analysis messages, free), then must open the final channel and write what the
constraint allows, then end (final_channel_constraint).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ridge.engine.structured import grammar_text
from ridge.sampling_params import StructuredOutputsParams
from ridge.serve.protocol import ChatCompletionRequest, RequestError
from ridge.tokenizer import IncrementalDetokenizer, RidgeTokenizer

MARKERS = {"start": "<|start|>", "channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>",
           "returned": "<|return|>", "call": "<|call|>", "constrain": "<|constrain|>"}
REASONING_PARSER = "openai_gptoss"  # vLLM's name for this reading, accepted by --reasoning-parser
TOOL_CALL_PARSER = "openai"  # and by --tool-call-parser


@dataclass(frozen=True)
class HarmonyTokens:
    """The markers' token ids in a model's vocabulary."""

    start: int
    channel: int
    message: int
    end: int
    returned: int
    call: int
    constrain: int | None

    @classmethod
    def of(cls, token_id: Callable[[str], int | None]) -> HarmonyTokens | None:
        """The markers of a vocabulary that has them all (<|constrain|> may be absent), else None."""
        ids = {name: token_id(text) for name, text in MARKERS.items()}
        if any(i is None for name, i in ids.items() if name != "constrain"):
            return None
        return cls(**ids)

    @property
    def closing(self) -> tuple[int, int, int]:
        return self.end, self.returned, self.call


@dataclass(frozen=True)
class Header:
    channel: str  # "" where the header names none
    recipient: str | None  # "functions.get_weather", where the message is addressed to a tool

    def kind(self, calls_offered: bool) -> str:
        """Where the body goes: "reasoning", "call" (only where the request offered tools) or "content"."""
        if self.channel == "analysis":
            return "reasoning"
        return "call" if self.recipient is not None and calls_offered else "content"


def parse_header(tokens: HarmonyTokens, ids: list[int], decode: Callable[[list[int]], str]) -> Header:
    """A message's header from its ids (between <|start|> and <|message|>, markers included)."""
    parts: dict[int | None, list[int]] = {None: [], tokens.channel: [], tokens.constrain: []}
    part: int | None = None  # the marker the ids follow: None (the role), <|channel|> or <|constrain|>
    for i in ids:
        if i in (tokens.channel, tokens.constrain):
            part = i
        elif i != tokens.start:
            parts[part].append(i)
    role_words, channel_words = decode(parts[None]).split(), decode(parts[tokens.channel]).split()
    recipient = next((w[3:] for w in role_words + channel_words if w.startswith("to=")), None)
    channel = next((w for w in channel_words if not w.startswith("to=")), "")
    return Header(channel, recipient or None)


@dataclass
class HarmonyDelta:
    """What a reply's new tokens complete."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape, each whole


class HarmonyStream:
    """A reply's thinking, answer and calls as its token ids stream in. Bodies go out as they decode (never half a
    UTF-8 character); a call goes out whole when its message closes. A whole reply fed at once with final=True
    reads as harmony_reply's."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: RidgeTokenizer, calls_offered: bool) -> None:
        self.tokens, self.tokenizer, self.calls_offered = tokens, tokenizer, calls_offered
        self._header: list[int] = []  # the open message's header, until its <|message|>
        self._body: IncrementalDetokenizer | None = None  # the open message's body, once its header closed
        self._kind = "content"
        self._call: tuple[str, list[str]] | None = None  # a call's recipient and the text of its arguments so far
        self._opened = False  # some message's body opened: the reply is harmony

    def feed(self, ids: list[int], final: bool) -> HarmonyDelta:
        """The reply's next token ids -> what they complete; final: the reply ended (cut off or finished)."""
        delta = HarmonyDelta()
        for i in ids:
            self._take(i, delta)
        if final:
            self._finish(delta)
        return delta

    def _take(self, token: int, delta: HarmonyDelta) -> None:
        tokens = self.tokens
        if self._body is None:  # in a header
            if token == tokens.message:
                self._open()
            elif token == tokens.start:
                self._header = [token]
            elif token in tokens.closing:  # a header closed without a body
                self._flush_unopened(delta)
            else:
                self._header.append(token)
            return
        if token in tokens.closing:
            self._close(delta)
            return
        self._route(self._body.add(token), delta)

    def _open(self) -> None:
        header = parse_header(self.tokens, self._header, self._decode)
        self._header, self._opened = [], True
        self._body = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        self._kind = header.kind(self.calls_offered)
        self._call = (header.recipient, []) if self._kind == "call" else None

    def _route(self, text: str, delta: HarmonyDelta) -> None:
        if self._kind == "reasoning":
            delta.reasoning += text
        elif self._kind == "call":
            self._call[1].append(text)
        else:
            delta.content += text

    def _close(self, delta: HarmonyDelta) -> None:
        if self._call is not None:
            recipient, arguments = self._call
            delta.calls.append(tool_call(recipient, "".join(arguments)))
        self._body, self._call = None, None

    def _finish(self, delta: HarmonyDelta) -> None:
        if self._call is not None:  # cut off mid-call: its arguments as text, not a call that cannot be made
            delta.content += "".join(self._call[1])
            self._body = self._call = None
        self._flush_unopened(delta)

    def _flush_unopened(self, delta: HarmonyDelta) -> None:
        """Tokens that no <|message|> followed: before any message opened, text of the reply's own (a reply that
        is not harmony, or one that continues the prompt's last message), as content; after, an empty message's
        header, dropped."""
        if not self._opened and self._header:
            delta.content += self.tokenizer.decode(self._header)
        self._header = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def tool_call(recipient: str, arguments: str) -> dict[str, Any]:
    """A call in OpenAI's shape: the function's name without harmony's `functions.` namespace; arguments that are
    JSON written again as json.dumps writes them (as the Hermes calls are), others as the model wrote them."""
    name = recipient.removeprefix("functions.")
    try:
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        arguments = arguments.strip()
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def harmony_reply(tokens: HarmonyTokens, tokenizer: RidgeTokenizer, ids: list[int],
                  calls_offered: bool) -> HarmonyDelta:
    """A whole reply's thinking, answer and calls."""
    return HarmonyStream(tokens, tokenizer, calls_offered).feed(ids, final=True)


def template_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a harmony template: an assistant message's reasoning_content (the field the server returns it
    in) given as `thinking`, where gpt-oss's template reads the analysis that preceded a call."""
    return [{**m, "thinking": m["reasoning_content"]}
            if m.get("role") == "assistant" and "reasoning_content" in m and "thinking" not in m else m
            for m in messages]


def chat_message(reply: HarmonyDelta, include_reasoning: bool, parallel_tool_calls: bool) -> tuple[dict[str, Any],
                                                                                                    bool]:
    """The assistant's chat message of a whole reply, and whether it holds tool calls."""
    message: dict[str, Any] = {"role": "assistant"}
    if include_reasoning:
        message["reasoning_content"] = reply.reasoning or None
    message["content"] = reply.content or None
    calls = reply.calls if parallel_tool_calls else reply.calls[:1]  # at most one, as asked
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


# A constrained reply: any number of thoughts, then the final answer, whose body is the request's grammar (by its
# name among llguidance's grammars). Thoughts are free text up to <|end|> (a special token, which no text lexeme
# matches); commentary is left out: its preambles would join the answer's content and its calls the answer.
_CONSTRAINED_REPLY = r"""
start: thought* answer
thought: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"
answer: <|channel|> "final" <|message|> @{answer}
TEXT: /(?s:.*)/
"""


def final_channel_constraint(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """A chat request's constraint as it holds a harmony reply: on the final channel's message only, the thinking
    before it free (vLLM's, which constrains the output after the reasoning ends). ValueError naming the field
    where `spec` is malformed."""
    text = grammar_text(spec)
    # the request's grammars (llguidance's JSON form: its first is the start), or its one Lark grammar
    grammars = json.loads(text)["grammars"] if text.lstrip().startswith("{") else [{"lark_grammar": text}]
    answer = grammars[0].setdefault("name", "answer")
    reply = {"name": "harmony_reply", "lark_grammar": _CONSTRAINED_REPLY.replace("{answer}", answer)}
    return StructuredOutputsParams(grammar=json.dumps({"grammars": [reply, *grammars]}))


def check_request(request: ChatCompletionRequest) -> None:
    """Refuse, by name, what a chat request to a harmony model asks that its reading cannot honour."""
    constrained = request.structured_field
    if constrained == "tool_choice":
        raise RequestError("tool_choice: required or a named function is not supported on a harmony (gpt-oss) chat "
                           "reply: its calls are written on the commentary channel, which the call grammar does not "
                           "hold; use auto", "tool_choice")
    if constrained is not None and request.calling_tools:
        raise RequestError(f"{constrained}: a constraint together with tools is not supported on a harmony (gpt-oss) "
                           "chat reply: the constraint holds the final answer, which leaves no call to make",
                           constrained)
    if not request.skip_special_tokens:
        raise RequestError("skip_special_tokens: false is not supported on a harmony (gpt-oss) chat reply: its "
                           "markers are read into the message's fields, not returned as text", "skip_special_tokens")
    if request.stop:
        raise RequestError("stop: stop strings are not supported on a harmony (gpt-oss) chat reply, which is read "
                           "from its token ids rather than its text", "stop")
