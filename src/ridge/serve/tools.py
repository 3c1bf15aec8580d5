"""Tool calling: the request's tools rendered through the model's chat template, the model's calls parsed out
of its text, and tool_choice "required" or a named function enforced by a grammar over the calls.

One format so far, Hermes' (Qwen2.5's template, NousResearch's models): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A model whose template shows no such tags
gets its tools refused by name rather than ignored.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ridge.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.DOTALL)


def supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template


@dataclass
class ParsedReply:
    content: str | None  # the text outside the calls, None when there is none
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}


def parse_reply(text: str) -> ParsedReply:
    """The calls in a model's reply; a block that is not a call's JSON stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[position:])
    content = "".join(kept).strip()
    return ParsedReply(content or None, calls)


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
