"""Tool calling: the request's tools rendered through the model's chat template, the model's calls parsed out
of its text (tool_choice "required" or a named function: serve/tool_grammars.py).

Eight formats: Hermes' (Qwen2.5's template, NousResearch's models), each call `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`; Qwen3-Coder's (Qwen3.5's and Qwen3-Next's templates too), each call
`<function=NAME>` between the same tags holding `<parameter=KEY>\\nVALUE\\n</parameter>` per argument, whose values
are text read as their parameter's JSON schema types them; Seed-OSS's, the same calls between `<seed:tool_call>`
tags, each value inside its parameter's tags without newlines; GLM-4.5's, each call the function's name then an
`<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pair per argument between the same tags (its values typed alike;
GLM-4.7's without the newlines between them); MiniMax-M2's, `<invoke name="NAME">` blocks holding a `<parameter
name="KEY">VALUE</parameter>` per argument between `<minimax:tool_call>` tags (typed alike); Mistral's,
`[TOOL_CALLS]` then a JSON list of calls to the reply's end (from its v11 tokenizers each call's name, `[ARGS]` and
its JSON arguments); Llama 3's, the whole reply a call's JSON, `{"name": ..., "parameters": {...}}`; and the pythonic
one of LFM2, a Python list of calls with literal keyword arguments, `<|tool_call_start|>[f(a=1),
g(b="x")]<|tool_call_end|>`. The chat template shows which (unless the server runs with --tool-call-parser); a model
whose template shows none, or does not render tools at all, gets its tools refused by name rather than ignored.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ridge.serve.tool_grammars import (
    GLM_FORMS,
    MINIMAX_OPEN,
    MISTRAL_ARGS,
    MISTRAL_OPEN,
    OPEN,
    PYTHON_TAG,
    PYTHONIC_OPEN,
    SEED_OPEN,
    raw_string,
    tags,
)

# --tool-call-parser: auto reads the format off the chat template
PARSERS = ("auto", "hermes", "qwen3_coder", "seed_oss", "pythonic", *GLM_FORMS, "minimax_m2", "mistral",
           "llama3_json")
# what Llama 3.1-3.3's templates show: their headers, and the JSON form they ask calls in
LLAMA_HEADER, LLAMA_CALL_FORM = "<|start_header_id|>", '"parameters": dictionary of argument name'
XML_FUNCTION = "<function="  # what Qwen3-Coder's templates show of its calls
GLM_ARGUMENT, GLM47_ARGUMENT = "<arg_key>", "</arg_key><arg_value>"  # GLM's; 4.7's pairs without a newline
PYTHONIC_TOOL_LIST = "<|tool_list_start|>"


def call_format(chat_template: str | None, parser: str = "auto") -> str | None:
    """The format of the model's calls (PARSERS' but auto): the operator's --tool-call-parser,
    or the one its template shows; None where tools cannot be offered (the template does not render them, or shows
    no format ridge parses)."""
    if not chat_template or "tools" not in chat_template:
        return None  # the model would never see them
    if parser != "auto":
        return parser
    if MINIMAX_OPEN in chat_template:
        return "minimax_m2"
    if SEED_OPEN in chat_template:
        return "seed_oss"
    if MISTRAL_OPEN in chat_template:
        return "mistral"
    if LLAMA_HEADER in chat_template and (PYTHON_TAG in chat_template or LLAMA_CALL_FORM in chat_template):
        return "llama3_json"
    if GLM_ARGUMENT in chat_template and OPEN in chat_template:
        return "glm47" if GLM47_ARGUMENT in chat_template else "glm45"
    if XML_FUNCTION in chat_template and OPEN in chat_template:  # both: Llama 3.1's prompts show <function= alone
        return "qwen3_coder"
    if PYTHONIC_OPEN in chat_template or PYTHONIC_TOOL_LIST in chat_template:
        return "pythonic"
    return "hermes" if OPEN in chat_template else None


def supports_tools(chat_template: str | None, parser: str = "auto") -> bool:
    """Whether tools can be offered (call_format's)."""
    return call_format(chat_template, parser) is not None


@dataclass
class ParsedReply:
    content: str | None  # the text outside the calls, None when there is none
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}


def parse_reply(text: str, form: str = "hermes", tools: list[dict[str, Any]] | None = None) -> ParsedReply:
    """The calls in a model's whole reply, in `form` (call_format's; tools: the request's, whose parameters type
    a qwen3_coder call's values); a block that is not calls stays in the content."""
    stream = CallStream(form, tools)
    content, calls = stream.feed(text, final=True)
    return ParsedReply(content or None, calls)


class CallStream:
    """A reply's calls parsed as its text streams in: the text outside calls goes out as it comes (holding back
    what may still open a call, and whitespace that may still end the reply: a reply's content is stripped),
    each call once its closing tag has come. A whole reply fed at once parses as parse_reply's."""

    def __init__(self, form: str = "hermes", tools: list[dict[str, Any]] | None = None) -> None:
        self._form = form
        self._open, self._close = tags(form)
        self._parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        self._pending = ""  # text not parsed yet: what may open a call, or a call still streaming
        self._space = ""  # whitespace held: it goes out only if more content follows
        self._started = False  # content has gone out (leading whitespace is dropped until then)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Take the reply's next text; return the content and the calls it completes (final: the reply ended)."""
        self._pending += text
        if self._form == "llama3_json":
            return self._feed_leading_calls(final)
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while (start := self._pending.find(self._open)) >= 0:
            if self._close:
                end = self._pending.find(self._close, start)
                if end < 0:
                    break  # a call still streaming: held until it closes (or the reply ends)
                stop = end + len(self._close)
            elif final:  # Mistral's: the calls run to the reply's end
                end = stop = len(self._pending)
            else:
                break
            found = self._calls(self._pending[start + len(self._open):end])
            content.append(self._pending[:start] if found is not None else self._pending[:stop])
            calls += found or []
            self._pending = self._pending[stop:]
        if final:
            content.append(self._pending)
            self._pending = ""
            return self._out("".join(content), final), calls
        held = self._pending.find(self._open)
        if held < 0:  # what could still open a call waits
            held = next((i for i in range(max(0, len(self._pending) - len(self._open) + 1), len(self._pending))
                         if self._open.startswith(self._pending[i:])), len(self._pending))
        content.append(self._pending[:held])
        self._pending = self._pending[held:]
        return self._out("".join(content), final), calls

    def _feed_leading_calls(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Llama 3's calls are the whole reply, JSON from its start (after <|python_tag|>): a reply that may still be
        calls is held until it ends; one that began as text streams as content."""
        head = self._pending.lstrip()
        may_be_calls = not self._started and (head[:1] == "{" or head.startswith(PYTHON_TAG)
                                              or PYTHON_TAG.startswith(head))
        if may_be_calls and not final:
            return "", []
        calls = _llama_calls(head) if may_be_calls else None
        content, self._pending = ("" if calls else self._pending), ""
        return self._out(content, final), calls or []

    def _calls(self, body: str) -> list[dict[str, Any]] | None:
        """The calls between a block's tags, or None where it is not calls in the stream's form."""
        if self._form == "pythonic":
            return _pythonic_calls(body)
        if self._form == "mistral":
            return _mistral_calls(body)
        if self._form == "minimax_m2":
            return _minimax_calls(body, self._parameters)
        if self._form == "seed_oss":
            return _xml_calls(body, self._parameters)
        if self._form in GLM_FORMS:
            call = _glm_call(body, self._parameters)
        else:
            call = _xml_call(body, self._parameters) if self._form == "qwen3_coder" else _call(body)
        return None if call is None else [call]

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
    return _openai_call(call["name"], call.get("arguments", {}))


_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_call(body: str, parameters: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A call in OpenAI's shape from Qwen3-Coder's form between the tags, or None when it is not one: each
    parameter's text read as its schema types it (`parameters`: each tool's parameters by name)."""
    match = _XML_CALL.fullmatch(body)
    if match is None:
        return None
    return _typed_call(match.group(1).strip(), _XML_PARAMETER.findall(match.group(2)), parameters)


def _xml_calls(body: str, parameters: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Seed-OSS's block: one or more calls in Qwen3-Coder's form, or None when it is not only that."""
    functions = re.findall(r"\s*<function=.*?</function>", body, re.S)
    if "".join(functions).strip() != body.strip() or not functions:
        return None
    calls = [_xml_call(function, parameters) for function in functions]
    return None if None in calls else calls  # type: ignore[return-value]


_GLM_CALL = re.compile(r"\s*([^\s<]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.S)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(body: str, parameters: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A call in OpenAI's shape from GLM-4.5's form between the tags (the function's name, then an <arg_key> /
    <arg_value> pair per argument, each value typed as a qwen3_coder call's is), or None when it is not one."""
    match = _GLM_CALL.fullmatch(body)
    if match is None:
        return None
    return _typed_call(match.group(1), _GLM_ARGUMENT.findall(match.group(2)), parameters)


_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_MINIMAX_PARAMETER = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def _minimax_calls(body: str, parameters: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The calls of MiniMax-M2's block (an <invoke name=...> each, holding a <parameter name=...> per argument, each
    value typed as a qwen3_coder call's is), or None when the block is not only that."""
    calls, rest = [], body
    while match := _MINIMAX_INVOKE.match(rest):
        name, inside = match.groups()
        pairs = []
        while argument := _MINIMAX_PARAMETER.match(inside):
            pairs.append(argument.groups())
            inside = inside[argument.end():]
        if inside.strip():
            return None
        calls.append(_typed_call(name, pairs, parameters))
        rest = rest[match.end():]
    return calls if calls and not rest.strip() else None


def _json_calls(objects: list[Any], arguments: tuple[str, ...] = ("arguments",)) -> list[dict[str, Any]] | None:
    """JSON calls ({"name": ..., "arguments": {...}}) in OpenAI's shape, or None where one is not a call."""
    calls = []
    for call in objects:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        given = next((call[key] for key in arguments if key in call), {})
        if not isinstance(given, dict):
            return None
        calls.append(_openai_call(call["name"], given))
    return calls or None


def _llama_calls(text: str) -> list[dict[str, Any]] | None:
    """Llama 3's calls: JSON objects {"name": ..., "parameters": {...}} (or "arguments"), "; " between them, after
    <|python_tag|> where the model writes one; None where the text is not only that."""
    text, objects, decoder = text.removeprefix(PYTHON_TAG).strip(), [], json.JSONDecoder()
    while text:
        try:
            obj, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            return None
        objects.append(obj)
        text = text[end:].lstrip().removeprefix(";").lstrip()
    return _json_calls(objects, ("parameters", "arguments"))


def _mistral_calls(body: str) -> list[dict[str, Any]] | None:
    """Mistral's calls after [TOOL_CALLS]: from its v11 tokenizers each call's name, [ARGS] and its JSON arguments,
    the next after [TOOL_CALLS] again; before them a JSON list of {"name", "arguments"} calls."""
    if MISTRAL_ARGS not in body:
        try:
            listed = json.loads(body)
        except json.JSONDecodeError:
            return None
        calls = _json_calls(listed if isinstance(listed, list) else [listed])
        return [{**call, "id": _mistral_id()} for call in calls] if calls else None
    calls = []
    for piece in body.split(MISTRAL_OPEN):
        name, separator, arguments = piece.partition(MISTRAL_ARGS)
        try:
            given = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not separator or not name.strip() or not isinstance(given, dict):
            return None
        calls.append(_openai_call(name.strip(), given, _mistral_id()))
    return calls


def _pythonic_calls(body: str) -> list[dict[str, Any]] | None:
    """The calls of a Python list of them, each a function name with literal keyword arguments (read by ast's
    literal_eval: no code runs), or None when the text is not that."""
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):  # not Python, or nested past what the parser takes
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                and all(keyword.arg is not None for keyword in call.keywords)):
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
            calls.append(_openai_call(call.func.id, arguments))
        except (ValueError, TypeError):  # not a literal, or one JSON has no form for (a set, bytes)
            return None
    return calls


def _typed_call(name: str, pairs: list[tuple[str, str]], parameters: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A call in OpenAI's shape from a function's name and its arguments' (key, text) pairs, each text read as its
    parameter's schema types it (`parameters`: each tool's parameters by name)."""
    properties = (parameters.get(name) or {}).get("properties") or {}
    return _openai_call(name, {key.strip(): _typed(value, properties.get(key.strip())) for key, value in pairs})


def _typed(text: str, schema: Any) -> Any:
    """A parameter's text as its value: as written where its schema makes it a string (tool_grammars.raw_string),
    else read as JSON (numbers, booleans, null, objects, arrays), as written where it is not JSON."""
    if raw_string(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _openai_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _mistral_id() -> str:
    """Mistral's templates refuse a conversation whose call ids are not 9 letters and digits (as vLLM makes them)."""
    return uuid.uuid4().hex[:9]


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
