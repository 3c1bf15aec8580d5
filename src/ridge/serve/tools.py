"""Tool calling: the request's tools rendered through the model's chat template, the model's calls parsed out
of its text, and tool_choice "required" or a named function enforced by a grammar over the calls.

One format so far, Hermes' (Qwen2.5's template, NousResearch's models): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A model whose template shows no such tags
(unless the server runs with --tool-call-parser hermes) or does not render tools at all gets its tools refused
by name rather than ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ridge.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"


PARSERS = ("auto", "hermes")  # --tool-call-parser: auto reads the format off the chat template


def supports_tools(chat_template: str | None, parser: str = "auto") -> bool:
    """Whether tools can be offered: the template renders them, and its calls are in a format ridge parses
    (shown by the template, or asserted by the operator's --tool-call-parser)."""
    if not chat_template or "tools" not in chat_template:
        return False  # the model would never see them
    return parser == "hermes" or OPEN in chat_template


@dataclass
class ParsedReply:
    content: str | None  # the text outside the calls, None when there is none
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}


def parse_reply(text: str) -> ParsedReply:
    """The calls in a model's whole reply; a block that is not a call's JSON stays in the content."""
    stream = CallStream()
    content, calls = stream.feed(text, final=True)
    return ParsedReply(content or None, calls)


class CallStream:
    """A reply's calls parsed as its text streams in: the text outside calls goes out as it comes (holding back
    what may still open a call, and whitespace that may still end the reply: a reply's content is stripped),
    each call once its closing tag has come. A whole reply fed at once parses as parse_reply's."""

    def __init__(self) -> None:
        self._pending = ""  # text not parsed yet: what may open a call, or a call still streaming
        self._space = ""  # whitespace held: it goes out only if more content follows
        self._started = False  # content has gone out (leading whitespace is dropped until then)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Take the reply's next text; return the content and the calls it completes (final: the reply ended)."""
        self._pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                break  # a call still streaming: held until it closes (or the reply ends)
            block = self._pending[start:end + len(CLOSE)]
            call = _call(block[len(OPEN):-len(CLOSE)])
            content.append(self._pending[:start] if call is not None else self._pending[:start] + block)
            if call is not None:
                calls.append(call)
            self._pending = self._pending[end + len(CLOSE):]
        if final:
            content.append(self._pending)
            self._pending = ""
            return self._out("".join(content), final), calls
        held = self._pending.find(OPEN)
        if held < 0:  # what could still open a call waits
            held = next((i for i in range(max(0, len(self._pending) - len(OPEN) + 1), len(self._pending))
                         if OPEN.startswith(self._pending[i:])), len(self._pending))
        content.append(self._pending[:held])
        self._pending = self._pending[held:]
        return self._out("".join(content), final), calls

    def _out(self, text: str, final: bool) -> str:
        """Content to hand out: whitespace at the reply's start is dropped, and at its end (it is held until
        more content follows it)."""
        text = self._space + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._space = "" if final else text[len(body):]
        self._started = self._started or bool(body)
        return body


def _call(body: str) -> dict[str, Any] | None:
    """A call in OpenAI's shape from the JSON between the tags, or None when it is not one."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


LITERAL_MARKERS = (json.dumps(OPEN), json.dumps(CLOSE))  # Lark string literals are JSON strings


def call_markers(token_id: Callable[[str], int | None]) -> tuple[str, str]:
    """The grammar's terms for the tags: the tokens themselves where the vocabulary has one for each (Qwen's):
    llguidance allows such a token where its text is expected but will not consume it as text."""
    ids = [token_id(tag) for tag in (OPEN, CLOSE)]
    if all(i is not None for i in ids):
        return f"<[{ids[0]}]>", f"<[{ids[1]}]>"
    return LITERAL_MARKERS


def calls_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool,
                  markers: tuple[str, str] = LITERAL_MARKERS) -> StructuredOutputsParams:
    """The grammar of a reply made of calls only (tool_choice "required", or `only` that function): one call, or
    with parallel calls several, each naming a tool and giving arguments valid against its parameters."""
    choices = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools if only is None or t["function"]["name"] == only]
    newline = json.dumps("\n")
    more = f" ({newline} call)*" if parallel else ""
    call = f"{markers[0]} {newline} %json {json.dumps({'anyOf': choices})} {newline} {markers[1]}"  # %json: a schema
    return StructuredOutputsParams(grammar=f"start: call{more}\ncall: {call}")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's call arguments as objects (OpenAI sends JSON
    text), and content present (empty) on a message that has only calls."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = json.loads(json.dumps(call))
                function = call.get("function") or {}
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"tool_calls: arguments are not JSON ({exc})") from exc
                calls.append(call)
            message["tool_calls"] = calls
            if message.get("content") is None:  # an assistant turn of calls only
                message["content"] = ""
        out.append(message)
    return out
