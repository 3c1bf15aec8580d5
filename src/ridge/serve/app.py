"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

Every request is tokenized and checked here, in the event loop, before it reaches the engine core;
a bad one gets OpenAI's error envelope with a 4xx status and changes nothing. A reply is built from
each request's whole output; a stream sends each step's new text (the output processor's deltas) as
server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import ridge
from ridge.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineRestarting,
    QueueFull,
    RequestFailed,
    ShuttingDown,
)
from ridge.engine.beam_search import BeamSearchParams, beam_search_async
from ridge.engine.outputs import CompletionOutput, OutputKind, RequestOutput
from ridge.engine.speculative import SpeculationStats
from ridge.sampling_params import SamplingParams
from ridge.serve.errors import BearerAuth, BodyLimit, JsonOnly, answer_errors_in_the_envelope, document_errors
from ridge.serve.metrics import EngineMetrics
from ridge.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    SamplingFields,
    TokenizeRequest,
    plain_messages,
)
from ridge.tokenizer import RidgeTokenizer

log = logging.getLogger("ridge")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer; nobody reads it


@dataclass
class ServerConfig:
    """What the server admits. Each limit is checked before the engine sees a request; a request over
    one gets a 400 (429 for the server-wide queue) naming the field and the limit."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    max_n: int = 128  # samples per request (OpenAI's limit)
    max_request_tokens: int = 2**18  # a request's work: prompt tokens + n x max_tokens, over all its prompts
    metrics_no_auth: bool = False  # /metrics open without the API key (for a scraper on a private network)


def build_app(engine: AsyncEngine, metrics: EngineMetrics, config: ServerConfig) -> FastAPI:
    tokenizer: RidgeTokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    app = FastAPI(title="ridge", version=ridge.__version__)
    app.add_middleware(JsonOnly)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:  # outermost: nothing but /health (and /metrics, if asked) answers without the key
        open_paths = {"/health"} | ({"/metrics"} if config.metrics_no_auth else set())
        app.add_middleware(BearerAuth, api_key=config.api_key, open_paths=open_paths)
    answer_errors_in_the_envelope(app)
    document_errors(app)

    # ---- helpers --------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise RequestError(f"The model `{name}` does not exist; this server serves `{config.model_name}`.",
                               "model", 404, "NotFoundError")

    def admit(prompts: list[list[int]], fields: SamplingFields, requested: int | None,
              logprobs: int | None, what: str) -> SamplingParams:
        """Check every prompt and the sampling fields; return the params. Raises before queuing anything."""
        if isinstance(fields.n, int) and fields.n > config.max_n:
            raise RequestError(f"n: {fields.n} samples asked for; the limit is {config.max_n} (--max-n)", "n")
        longest = max(len(p) for p in prompts)
        if requested is not None and longest + requested > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{longest + requested} tokens ({longest} in the {what}, {requested} for the completion). "
                "Please reduce the length of the prompt or completion.", what)
        max_tokens = requested if requested is not None else max(1, max_model_len - longest)
        params = fields.sampling_params(max_tokens, logprobs)
        for ids in prompts:
            try:
                engine.validate(ids, params)
            except ValueError as exc:
                message = str(exc)
                raise RequestError(message, what if message.startswith("prompt") else message.split(":")[0]) from exc
        work = sum(len(p) for p in prompts) + len(prompts) * params.n * max_tokens
        if work > config.max_request_tokens:
            raise RequestError(
                f"max_tokens: this request's work is {work} tokens (prompt + n x max_tokens = "
                f"{sum(len(p) for p in prompts)} + {len(prompts) * params.n} x {max_tokens}); the limit is "
                f"{config.max_request_tokens} (--max-request-tokens). Lower n or max_tokens.", "max_tokens")
        try:  # here, not only in generate(): a stream's status line goes out before generate() runs
            engine.check_admission(len(prompts) * params.n, work)
        except (QueueFull, ShuttingDown, EngineDead) as exc:
            raise engine_errors(exc) from exc
        return params

    async def run(prompts: list[list[int]], params: SamplingParams, request_id: str,
                  beams: BeamSearchParams | None = None,
                  kind: OutputKind = OutputKind.FINAL) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts of one API request, interleaved as they come: (prompt index, output).
        A beam search yields each prompt's final output only, its params.n best beams as the choices."""
        if beams is not None:
            results = await beam_search_async(engine, prompts, beams, request_id)
            for i, result in enumerate(results):
                choices = [CompletionOutput(j, h.text, h.token_ids, "stop" if h.finished else "length",
                                            cumulative_logprob=h.cumulative_logprob)
                           for j, h in enumerate(result.sequences[:params.n])]
                yield i, RequestOutput(f"{request_id}-{i}", None, result.prompt_token_ids, choices, True)
            return
        if len(prompts) == 1:  # the common case, without a task and a queue in between
            async with contextlib.aclosing(engine.generate(prompts[0], params, f"{request_id}-0", kind)) as outputs:
                async for out in outputs:  # aclosing: a disconnect aborts the request now, not at garbage collection
                    yield 0, _unless_aborted(out)
            return
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for out in engine.generate(ids, params, f"{request_id}-{i}", kind):
                    merged.put_nowait((i, out))
            except (Exception, asyncio.CancelledError) as exc:
                merged.put_nowait(exc)
                return
            merged.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item[0], _unless_aborted(item[1])
        finally:
            for task in tasks:  # a disconnect or an error: cancelling a pump aborts its request
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def engine_errors(exc: Exception) -> RequestError:
        if isinstance(exc, QueueFull):
            return RequestError(str(exc), None, 429, "RateLimitError")
        if isinstance(exc, EngineRestarting):
            return RequestError(str(exc), None, 503, "ServiceUnavailableError",
                                {"Retry-After": str(exc.retry_after_s)})
        if isinstance(exc, ShuttingDown | EngineDead):
            return RequestError(str(exc), None, 503, "ServiceUnavailableError")
        if isinstance(exc, RequestFailed):
            return RequestError(str(exc), None, 500, "InternalServerError")
        if isinstance(exc, ValueError):
            return RequestError(str(exc), str(exc).split(":")[0])
        raise exc

    async def collect(prompts: list[list[int]], params: SamplingParams, request_id: str,
                      beams: BeamSearchParams | None = None) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in run(prompts, params, request_id, beams):
                finals[i] = out
        except (QueueFull, ShuttingDown, EngineDead, RequestFailed, ValueError) as exc:
            raise engine_errors(exc) from exc
        return finals  # type: ignore[return-value]

    def usage(prompts: list[list[int]], completion: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The usage block: completion tokens counted by the caller (a stream's outputs carry only news)."""
        prompt_tokens = sum(len(p) for p in prompts)
        result = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion,
                  "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}
        drafts = sum(o.metrics.get("spec_drafts") or 0 for o in outputs)
        if drafts:  # speculative decoding ran for this request: what the drafter achieved on it
            spec = SpeculationStats(drafts, sum(o.metrics["spec_draft_tokens"] for o in outputs),
                                    sum(o.metrics["spec_accepted_tokens"] for o in outputs))
            result["spec_decode"] = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                                     "num_accepted_tokens": spec.num_accepted_tokens,
                                     "acceptance_rate": spec.acceptance_rate,
                                     "mean_accepted_length": spec.mean_accepted_length}
        return result

    # ---- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 with its state (starting, restarting, stuck, dead) otherwise."""
        health = engine.health()
        if health.status == "ok":
            return JSONResponse({"status": "ok"})
        headers = {"Retry-After": str(health.retry_after_s)} if health.retry_after_s is not None else None
        return JSONResponse({"status": health.status, "message": health.message}, status_code=503, headers=headers)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ridge.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ridge", "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = chat_ids(req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
                               "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def chat_ids(messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return tokenizer.encode_chat(plain_messages(messages), add_generation_prompt)
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from exc

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        prompts = _prompt_list(req.prompt)
        ids_list = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        params = admit(ids_list, req, req.max_tokens, req.logprobs, "prompt")
        beams = req.beam_search_params(params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else "" for p in prompts]

        def choice(i: int, c: CompletionOutput, text: str, new_ids: list[int], new_logprobs, offset: int):
            return {"index": i * params.n + c.index, "text": text,
                    "logprobs": _completion_logprobs(tokenizer, new_ids, new_logprobs, offset)
                    if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        if not req.stream:
            outputs = await until_disconnected(request, collect(ids_list, params, request_id, beams))
            if outputs is None:
                return Response(status_code=CLIENT_CLOSED)
            choices = [choice(i, c, echoes[i] + c.text, c.token_ids, c.logprobs, len(echoes[i]))
                       for i, o in enumerate(outputs) for c in o.outputs]
            return {"id": request_id, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": choices, "usage": usage(ids_list, _num_tokens(outputs), outputs)}

        async def events() -> AsyncIterator[str]:
            head = {"id": request_id, "object": "text_completion", "created": created, "model": config.model_name}
            sent: dict[tuple[int, int], int] = {}  # (prompt, choice) -> characters sent: the logprobs' text offset
            finals: dict[int, RequestOutput] = {}
            completion = 0
            async for i, out in _guard(run(ids_list, params, request_id, beams, OutputKind.DELTA)):
                if isinstance(out, RequestError):
                    yield sse(out.body())
                    break
                finals[i] = out
                completion += _num_tokens([out])
                for c in out.outputs:
                    offset = sent.get((i, c.index))
                    text = c.text if offset is not None else echoes[i] + c.text  # the echo opens a choice
                    offset = offset or 0
                    sent[(i, c.index)] = offset + len(text)
                    yield sse({**head, "choices": [choice(i, c, text, c.token_ids, c.logprobs, offset)]})
            if req.include_usage and len(finals) == len(ids_list):
                yield sse({**head, "choices": [], "usage": usage(ids_list, completion, list(finals.values()))})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        top = req.logprobs_asked()
        ids = chat_ids(req.messages, req.add_generation_prompt)
        params = admit([ids], req, req.requested_max_tokens(), top, "messages")
        beams = req.beam_search_params(params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def logprobs(new_ids: list[int], new_lps) -> dict[str, Any] | None:
            return _chat_logprobs(tokenizer, new_ids, new_lps, top) if top is not None else None

        if not req.stream:
            outputs = await until_disconnected(request, collect([ids], params, request_id, beams))
            if outputs is None:
                return Response(status_code=CLIENT_CLOSED)
            (output,) = outputs
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c.token_ids, c.logprobs),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for c in output.outputs]
            return {"id": request_id, "object": "chat.completion", "created": created, "model": config.model_name,
                    "choices": choices, "usage": usage([ids], _num_tokens(outputs), outputs)}

        async def events() -> AsyncIterator[str]:
            head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": config.model_name}
            for index in range(params.n):  # OpenAI opens every choice with the role
                yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            final: RequestOutput | None = None
            completion = 0
            async for _, out in _guard(run([ids], params, request_id, beams, OutputKind.DELTA)):
                if isinstance(out, RequestError):
                    yield sse(out.body())
                    break
                final = out
                completion += _num_tokens([out])
                for c in out.outputs:
                    delta = {"content": c.text} if c.text or not c.finish_reason else {}
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": logprobs(c.token_ids, c.logprobs),
                        "finish_reason": c.finish_reason}]})
            if req.include_usage and final is not None:
                yield sse({**head, "choices": [], "usage": usage([ids], completion, [final])})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _guard(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
        """A stream's engine-side failure becomes an error event: its HTTP status has already been sent."""
        try:
            async for item in outputs:
                yield item
        except (QueueFull, ShuttingDown, EngineDead, RequestFailed, ValueError) as exc:
            yield -1, engine_errors(exc)

    return app


def _unless_aborted(out: RequestOutput) -> RequestOutput:
    """A request the server itself aborted (its client is still there: the server is shutting down) ends
    with an error, never as a reply cut short."""
    if any(c.finish_reason == "abort" for c in out.outputs):
        raise ShuttingDown("the server is shutting down; this request was stopped before it finished")
    return out


# Characters that JSON leaves raw but that str.splitlines() -- and so clients that split an event stream
# with it, httpx's aiter_lines among them -- takes for line ends: escaped, an event stays on one line.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event, on one line whatever the text holds."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def _num_tokens(outputs: list[RequestOutput]) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise RequestError("prompt: must not be empty", "prompt")
    return prompts


def _completion_logprobs(tokenizer: RidgeTokenizer, ids: list[int], logprobs: list[dict[int, float]] | None,
                         offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [tokenizer.token_text(t) for t in ids]
    entries = logprobs or [{} for _ in ids]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": [e.get(t) for t, e in zip(ids, entries, strict=True)],
            "top_logprobs": [{tokenizer.token_text(k): v for k, v in e.items()} for e in entries],
            "text_offset": offsets}


def _chat_logprobs(tokenizer: RidgeTokenizer, ids: list[int], logprobs: list[dict[int, float]] | None,
                   top: int) -> dict[str, Any]:
    def item(token_id: int, value: float) -> dict[str, Any]:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(ids, logprobs or [{} for _ in ids], strict=True):
        alternatives = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(token_id, entry.get(token_id, float("nan"))),
                        "top_logprobs": [item(k, v) for k, v in alternatives]})
    return {"content": content}


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnects first: then `work` is cancelled, which aborts its
    requests in the engine. Streams notice a disconnect by themselves; a plain response would not."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
