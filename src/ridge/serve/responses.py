"""OpenAI's Responses API (POST /v1/responses), served through the chat completions route.

A Responses request becomes a chat completion request (its input items the conversation's messages, its function
tools and text format the chat fields that do the same), which the chat route runs as any other: templates, tool
parsing, reasoning parsers and gpt-oss's harmony channels all apply. Its reply becomes a Response (output items:
the reasoning, the message, the function calls), and its stream of chunks becomes the Responses stream of events
(each item added, its text's deltas, done; then response.completed).

What the chat route cannot do is refused by name: stored state (previous_response_id, conversation, store, background),
the hosted tools (web search, file search, code interpreter...), inputs other than text, reasoning summaries.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from ridge.serve.protocol import (
    Body,
    ChatCompletionRequest,
    RequestError,
    Text,
    check_unicode,
    log_labels,
    refuse_unsupported,
)

# Fields of OpenAI's Responses API that ask for what this server does not do: refused when they ask for anything.
UNSUPPORTED = {
    "previous_response_id": "this server stores no responses; send the whole conversation as input",
    "conversation": "this server stores no conversations; send the whole conversation as input",
    "store": "this server stores no responses; leave store out or false",
    "background": "responses are served in the request, not in the background",
    "prompt": "stored prompt templates are not supported",
    "include": "no extra output data is available (encrypted reasoning, hosted tools' results, logprobs)",
    "max_tool_calls": "not supported; the model's calls are returned as it makes them",
    "top_logprobs": "not supported on /v1/responses; use /v1/chat/completions",
    "context_management": "not supported",
    "truncation": "only 'disabled' is supported: a conversation past the context is refused",
    "kv_transfer_params": "disaggregated prefill reads completions and chat bodies; send this one to the decode "
                          "server whole",
}
OBFUSCATION_BYTES = 48  # a padded delta event's padding: 1 to this many random bytes, base64url
# Responses' label fields (protocol.py's LABELS: logged when set); metadata is echoed in the response
LABELS = ("user", "service_tier", "safety_identifier", "request_id")
ROLES = ("user", "system", "developer", "assistant")
# the chat field an error names -> the Responses field the client sent
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


class ResponseStreamOptions(Body):
    # OpenAI's padding of each delta event with random characters of random length (its `obfuscation` field), against
    # a network observer reading token lengths from event sizes; OpenAI pads by default, ridge where asked
    include_obfuscation: bool = False


class ResponsesRequest(Body):
    model: Text | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    priority: int = 0  # vLLM's: lower goes first, on a server started with --schedule-policy priority
    stream_options: ResponseStreamOptions | None = None
    # a routing hint (protocol.py's LABELS says why it is not logged); its retention: in memory is what this server
    # does, "24h" refused in _unsupported
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unsupported(data, UNSUPPORTED, {"truncation": ("disabled",)})
            if data.get("prompt_cache_retention") == "24h":
                raise ValueError("prompt_cache_retention: '24h' is not supported; the prefix cache keeps a prompt's "
                                 "blocks in memory until the KV pool needs them")
            log_labels(data, LABELS)
        return data

    @model_validator(mode="after")
    def _unicode(self) -> ResponsesRequest:
        check_unicode(self.input, "input")
        check_unicode(self.tools, "tools")
        return self


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that does what `req` asks (a RequestError naming the Responses field where
    something cannot be said that way)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls, "priority": req.priority}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        body.update(_text_format(req.text))
    if req.reasoning is not None:
        body.update(_reasoning(req.reasoning))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        head, *rest = [str(part) for part in error["loc"]]
        where = ".".join([FIELD_NAMES.get(head, head), *rest])
        raise RequestError(f"{where}: {error['msg']}", where) from exc


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation: instructions first (as a system message), then the input items."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("input: must not be empty", "input")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise RequestError(f"input.{i}.role: {role!r} is not one of {', '.join(ROLES)}", f"input.{i}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))):
                raise RequestError(f"input.{i}: a function_call item needs call_id, name and arguments strings",
                                   f"input.{i}")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # parallel calls, or calls after the reply's text
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"input.{i}.call_id: a function_call_output item needs its call's call_id",
                                   f"input.{i}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"input.{i}.output")})
        else:
            raise RequestError(f"input.{i}.type: {kind!r} items are not supported; this server reads messages, "
                               "function_call and function_call_output items (reasoning items are not read back: "
                               "leave them out)", f"input.{i}.type")
    return messages


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat route: its text (_text), or, where it holds input_image parts, chat parts
    (text, and image_url for each image: the chat route reads them on a vision model)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
                raise RequestError(f"{where}.{j}.image_url: an input_image needs its image_url (a data: or http(s) "
                                   "URL); file_id is not supported", f"{where}.{j}.image_url")
            if part.get("detail", "auto") != "auto":
                raise RequestError(f"{where}.{j}.detail: {part['detail']!r} is not supported (auto: the model's own "
                                   "pixel budget sizes each image)", f"{where}.{j}.detail")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{where}.{j}")})
    return parts


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or its text parts (input_text, output_text) joined; other parts refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of text parts", where)
    return "".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text"):
        raise RequestError(f"{where}.type: {kind!r} parts are not supported; this server reads text and input_image "
                           "parts", f"{where}.type")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text: must be a string", f"{where}.text")
    return part["text"]


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise RequestError(f"tools.{i}.type: {tool.get('type')!r} tools are hosted by OpenAI; this server runs "
                           "function tools only", f"tools.{i}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError(f"tool_choice: {choice!r} is not supported; use auto, none, required or "
                           '{"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: dict[str, Any]) -> dict[str, Any]:
    if text.get("verbosity") is not None:
        raise RequestError("text.verbosity: not supported", "text.verbosity")
    extra = set(text) - {"format", "verbosity"}
    if extra:
        raise RequestError(f"text.{sorted(extra)[0]}: not a field of text", f"text.{sorted(extra)[0]}")
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, dict):
        raise RequestError("text.format: must be an object with a type", "text.format")
    kind = form.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: form[k] for k in ("name", "description", "schema", "strict") if k in form}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise RequestError(f"text.format.type: {kind!r} is not one of text, json_object, json_schema",
                       "text.format.type")


def _reasoning(reasoning: dict[str, Any]) -> dict[str, Any]:
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise RequestError(f"reasoning.{name}: reasoning summaries are not supported; the reasoning comes whole "
                               "as a reasoning item", f"reasoning.{name}")
    return {"reasoning_effort": reasoning["effort"]} if reasoning.get("effort") is not None else {}


def responses_error(exc: RequestError) -> RequestError:
    """The chat route's error, naming the Responses field the client sent."""
    param = exc.param or ""
    head, _, rest = param.partition(".")
    renamed = FIELD_NAMES.get(head, head)
    if head == "tools" and rest.count(".") >= 2:  # tools.0.function.parameters -> tools.0.parameters
        index, _, inner = rest.partition(".")
        rest = f"{index}.{inner.removeprefix('function.')}"
    if not param or (renamed == head and head != "tools"):
        return exc
    new = f"{renamed}.{rest}" if rest else renamed
    message = exc.message.replace(param, new, 1) if exc.message.startswith(param) else exc.message
    return RequestError(message, new, exc.status, exc.type, exc.headers)


class ResponseBuilder:
    """A Response's envelope and its output items, from a chat reply or from its stream."""

    def __init__(self, req: ResponsesRequest, model: str, created: int, count_tokens: Callable[[str], int]) -> None:
        self.req, self.model, self.created, self.count_tokens = req, model, created, count_tokens
        self.id = f"resp_{uuid.uuid4().hex}"

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 incomplete: bool = False) -> dict[str, Any]:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
                "reasoning": req.reasoning, "store": False, "background": False, "previous_response_id": None,
                "usage": usage}

    def usage(self, chat_usage: dict[str, Any] | None, reasoning: str) -> dict[str, Any] | None:
        """Responses' usage from the chat usage; the reasoning's tokens are its text's, encoded again."""
        if chat_usage is None:
            return None
        details = chat_usage.get("prompt_tokens_details") or {}
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                "total_tokens": chat_usage["total_tokens"]}

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [_output_text(text)] if status == "completed" else []
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}

    def from_chat(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The Response of a whole chat reply."""
        choice = reply["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning_content") or ""
        output = []
        if reasoning:
            output.append(self.reasoning_item(_item_id("rs"), reasoning))
        if message.get("content"):
            output.append(self.message_item(_item_id("msg"), message["content"]))
        output += [self.call_item(_item_id("fc"), call) for call in message.get("tool_calls") or []]
        incomplete = choice["finish_reason"] == "length"
        return self.envelope("incomplete" if incomplete else "completed", output,
                             self.usage(reply.get("usage"), reasoning), incomplete)

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        """The Responses stream of events of a chat stream's chunks."""
        stream = _EventStream(self)
        async for event in stream.run(chunks):
            yield event


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _EventStream:
    """One response's events: at most one open item at a time (the reasoning, then the message's text), each
    call an item of its own; every event numbered."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.open: tuple[Literal["reasoning", "message"], str, list[str]] | None = None  # kind, id, texts
        self.reasoning = ""

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _open(self, kind: Literal["reasoning", "message"]) -> list[str]:
        item_id = _item_id("rs" if kind == "reasoning" else "msg")
        self.open = (kind, item_id, [])
        b, index = self.builder, len(self.output)
        item = b.reasoning_item(item_id, "", "in_progress") if kind == "reasoning" else b.message_item(
            item_id, "", "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                            part=part)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, item_id, texts = self.open
        self.open = None
        text, index = "".join(texts), len(self.output)
        if kind == "reasoning":
            item, part, done = self.builder.reasoning_item(item_id, text), {"type": "reasoning_text", "text": text}, \
                "response.reasoning_text.done"
            self.reasoning += text
        else:
            item, part, done = self.builder.message_item(item_id, text), _output_text(text), "response.output_text.done"
        self.output.append(item)
        return [self._event(done, item_id=item_id, output_index=index, content_index=0, text=text),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, kind: Literal["reasoning", "message"], delta: str) -> list[str]:
        events = []
        if self.open is None or self.open[0] != kind:
            events += self._close() + self._open(kind)
        _, item_id, texts = self.open
        texts.append(delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self._delta(name, item_id=item_id, output_index=len(self.output), content_index=0,
                                     delta=delta, **extra)]

    def _delta(self, kind: str, **fields: Any) -> str:
        """A delta event, padded where the request asked for obfuscation: its size then says little of its text's."""
        options = self.builder.req.stream_options
        if options is not None and options.include_obfuscation:
            fields["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(OBFUSCATION_BYTES) + 1)
        return self._event(kind, **fields)

    def _call(self, call: dict[str, Any]) -> list[str]:
        events, item_id, index = self._close(), _item_id("fc"), len(self.output)
        b, arguments = self.builder, call["function"]["arguments"]
        item = b.call_item(item_id, call)
        self.output.append(item)
        return [*events, self._event("response.output_item.added", output_index=index,
                                     item=b.call_item(item_id, call, "in_progress")),
                self._delta("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=arguments),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=arguments),
                self._event("response.output_item.done", output_index=index, item=item)]

    async def run(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        b = self.builder
        yield self._event("response.created", response=b.envelope("in_progress", [], None))
        yield self._event("response.in_progress", response=b.envelope("in_progress", [], None))
        finish, usage = None, None
        async for raw in chunks:
            text = raw.decode() if isinstance(raw, bytes) else raw
            if not text.startswith("data: {"):  # [DONE]
                continue
            chunk = json.loads(text[6:])
            if "error" in chunk:  # the engine failed the request mid-stream
                error = chunk["error"]
                yield self._event("error", code=str(error.get("code")), message=error.get("message"),
                                  param=error.get("param"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for event in (self._text("reasoning", delta["reasoning_content"])
                              if delta.get("reasoning_content") else []):
                    yield event
                for event in self._text("message", delta["content"]) if delta.get("content") else []:
                    yield event
                for call in delta.get("tool_calls") or []:
                    for event in self._call(call):
                        yield event
                finish = choice.get("finish_reason") or finish
        for event in self._close():
            yield event
        incomplete = finish == "length"
        status = "incomplete" if incomplete else "completed"
        yield self._event(f"response.{status}",
                          response=b.envelope(status, self.output, b.usage(usage, self.reasoning), incomplete))
