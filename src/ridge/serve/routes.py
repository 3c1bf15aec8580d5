"""The OpenAI-compatible routes: completions, chat completions, tokenize / detokenize, models, health,
version and Prometheus metrics. Replies are built from each request's whole output; a stream sends
each step's new text (the output processor's deltas) as server-sent events."""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import ridge
from ridge.engine.outputs import CompletionOutput, OutputKind, RequestOutput
from ridge.engine.scheduler import check_priority
from ridge.engine.scoring import ScorePlan, check_classifier
from ridge.lora.request import LoRARequest
from ridge.sampling_params import SamplingParams
from ridge.serve import harmony
from ridge.serve.gateway import Gateway, guard, until_disconnected
from ridge.serve.harmony import HarmonyStream
from ridge.serve.kv_transfer import PrefixPusher, check_push, import_route
from ridge.serve.metrics import EngineMetrics
from ridge.serve.pooling import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
    classify_reply,
    rerank_reply,
    score_reply,
)
from ridge.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RequestError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    last_tokens,
)
from ridge.serve.reasoning import ReasoningStream, constrained_parser, split_reply
from ridge.serve.reasoning import tags as reasoning_tags
from ridge.serve.responses import ResponseBuilder, ResponsesRequest, responses_error, to_chat
from ridge.serve.tool_grammars import are_control_tokens, call_markers, tags
from ridge.serve.tools import CallStream, parse_reply
from ridge.tokenizer import RidgeTokenizer

CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer; nobody reads it


class Routes:
    """The endpoints, as methods: build_app registers each at its path."""

    def __init__(self, gateway: Gateway, metrics: EngineMetrics) -> None:
        self.gateway = gateway
        self.engine, self.config, self.tokenizer = gateway.engine, gateway.config, gateway.tokenizer
        self.pusher = PrefixPusher(gateway.engine) if gateway.config.role == "prefill" else None
        self.metrics = metrics

    async def health(self) -> Response:
        """200 while the engine serves; 503 with its state (starting, restarting, stuck, dead) otherwise."""
        health = self.engine.health()
        if health.status == "ok":
            return JSONResponse({"status": "ok"})
        headers = {"Retry-After": str(health.retry_after_s)} if health.retry_after_s is not None else None
        return JSONResponse({"status": health.status, "message": health.message}, status_code=503, headers=headers)

    async def version(self) -> dict[str, str]:
        return {"version": ridge.__version__}

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card(None),
                                           *(self._model_card(a) for a in self.gateway.adapters.values())]}

    async def model(self, model_id: str) -> dict[str, Any]:
        return self._model_card(self.gateway.adapter_for(model_id))

    def _model_card(self, adapter: LoRARequest | None) -> dict[str, Any]:
        """The base model's card, or a LoRA adapter's (vLLM's: its path as root, the base model as parent)."""
        card = {"id": self.config.model_name if adapter is None else adapter.lora_name, "object": "model",
                "created": int(time.time()), "owned_by": "ridge", "max_model_len": self.engine.max_model_len}
        if adapter is not None:
            card.update(root=adapter.lora_path, parent=self.config.model_name)
        return card

    async def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's special tokens and chat template, as vLLM's endpoint gives them (lm-eval's remote
        tokenizer reads it, then tokenizes through /tokenize)."""
        info, text = self.tokenizer.info, self.tokenizer.token_text
        return {"tokenizer_class": "ridge (Hugging Face tokenizers)",
                "bos_token": text(info.bos_token_id) if info.bos_token_id is not None else None,
                "eos_token": text(info.eos_token_id) if info.eos_token_id is not None else None,
                "pad_token": None, "add_bos_token": info.add_bos, "chat_template": info.chat_template,
                "model_max_length": self.engine.max_model_len, "vocab_size": self.tokenizer.vocab_size}

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.gateway.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = self.gateway.chat_ids(req.messages, req.add_generation_prompt, options=req.chat_options())
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        self.gateway.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: token id {bad} is outside the vocabulary [0, {self.tokenizer.vocab_size})",
                               "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> Response:
        if req.load_inplace:
            raise RequestError("load_inplace: replacing a served adapter is not supported; unload it first",
                               "load_inplace")
        await self.gateway.load_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> Response:
        served = self.gateway.adapters.get(req.lora_name)
        if served is not None and req.lora_int_id not in (None, served.lora_int_id):
            raise RequestError(f"lora_int_id: {req.lora_name!r} is served with id {served.lora_int_id}, not "
                               f"{req.lora_int_id}", "lora_int_id")
        await self.gateway.unload_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def kv_import(self, request: Request) -> Any:
        return await import_route(self.engine, request)

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        adapter = self.gateway.adapter_for(req.model)
        model_name = self.config.model_name if adapter is None else adapter.lora_name
        check_push(self.config.role, req.kv_transfer_params, req.stream)
        prompts = _prompt_list(req.prompt)
        if req.suffix:
            if req.truncate_prompt_tokens is not None:
                raise RequestError("truncate_prompt_tokens: not supported with suffix (cutting a fill-in-the-middle "
                                   "prompt's start would cut its prefix marker)", "truncate_prompt_tokens")
            try:
                ids_list = [self.tokenizer.encode_infill(p, req.suffix) for p in prompts]
            except ValueError as exc:
                raise RequestError(str(exc), "suffix") from exc
        else:
            ids_list = [req.truncated(self.tokenizer.encode(p) if isinstance(p, str) else p, self.engine.max_model_len)
                        for p in prompts]
        # ranking best_of's samples needs each one's cumulative logprob: logprobs are kept (shown if asked)
        logprobs = req.logprobs if req.logprobs is not None or not req.ranks_samples else 0
        params = self.gateway.admit(ids_list, req, req.generated_max_tokens(), logprobs, "prompt")
        beams = req.beam_search_params(params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # the prompt as given, or, where it was cut or given as ids, the text of the ids the model read
        echoes = [(p if isinstance(p, str) and req.truncate_prompt_tokens is None else self.tokenizer.decode(ids))
                  if req.echo else "" for p, ids in zip(prompts, ids_list, strict=True)]
        scored: dict[int, list[dict[int, float] | None]] = {}  # prompt -> its prompt logprobs, once they came

        def choice(i: int, c: CompletionOutput, opens: bool, offset: int) -> dict[str, Any]:
            """A choice of prompt i: c's text (opened by the echo when `opens`), c's text starting at `offset`."""
            c = _without_generation(c) if req.echo_only else c
            ids, entries = c.token_ids, c.logprobs
            if opens and req.echo and req.logprobs is not None:  # the echoed prompt's tokens are scored too
                prompt = ids_list[i]
                ids, entries = prompt + ids, [_top(e, req.logprobs, t) for e, t in zip(scored[i], prompt, strict=True)]
                entries += c.logprobs or []
            out = {"index": i * req.n + c.index, "text": echoes[i] + c.text if opens else c.text,
                   "logprobs": _completion_logprobs(self.tokenizer, ids, entries, 0 if opens else offset,
                                                    req.return_tokens_as_token_ids)
                   if req.logprobs is not None else None,
                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if opens and req.prompt_logprobs is not None:
                out["prompt_logprobs"] = _prompt_logprobs(self.tokenizer, ids_list[i], scored[i], req.prompt_logprobs)
            if req.return_token_ids:  # the generated ids (a stream: this chunk's), the prompt's with the first
                out["token_ids"] = c.token_ids
                if opens:
                    out["prompt_token_ids"] = ids_list[i]
            return out

        if not req.stream:
            outputs = await until_disconnected(request, self.gateway.collect(ids_list, params, request_id, beams,
                                                                             adapter, req.priority))
            if outputs is None:
                return Response(status_code=CLIENT_CLOSED)
            scored.update((i, o.prompt_logprobs) for i, o in enumerate(outputs))
            completion = 0 if req.echo_only else _num_tokens(outputs)  # best_of: every sample drawn counts
            choices = [choice(i, c, True, 0) for i, o in enumerate(outputs)
                       for c in (_best(o.outputs, req.n) if req.ranks_samples else o.outputs)]
            reply = {"id": request_id, "object": "text_completion", "created": created,
                     "model": model_name, "choices": choices,
                     "usage": self.gateway.usage(ids_list, completion, outputs)}
            if req.kv_transfer_params is not None:  # the first prompt's (a router sends one)
                reply["kv_transfer_params"] = await self.pusher.push(ids_list[0], req.cache_salt,
                                                                     req.kv_transfer_params)
            return reply

        async def events() -> AsyncIterator[str]:
            head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
            sent: dict[tuple[int, int], int] = {}  # (prompt, choice) -> characters sent: the logprobs' text offset
            finals: dict[int, RequestOutput] = {}
            completion = 0
            async for i, out in guard(self.gateway.run(ids_list, params, request_id, beams, OutputKind.DELTA,
                                                       adapter, req.priority)):
                if isinstance(out, RequestError):
                    yield sse(out.body())
                    break
                finals[i] = out
                completion += 0 if req.echo_only else _num_tokens([out])
                if out.prompt_logprobs is not None:
                    scored[i] = out.prompt_logprobs
                so_far = {"usage": self.gateway.usage_so_far(ids_list, completion)} if req.continuous_usage else {}
                for c in out.outputs:
                    offset = sent.get((i, c.index))
                    item = choice(i, c, offset is None, offset or 0)  # the echo opens a choice
                    sent[(i, c.index)] = (offset or 0) + len(item["text"])
                    yield sse({**head, "choices": [item], **so_far})
            if req.include_usage and len(finals) == len(ids_list):
                usage = self.gateway.usage(ids_list, completion, list(finals.values()))
                yield sse({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def embeddings(self, req: EmbeddingRequest, request: Request) -> Any:
        """OpenAI's /v1/embeddings, on a server started with --runner pooling: each input's embedding."""
        self._check_pooling("model")
        if len(self.engine.labels):
            raise RequestError("model: this model is a classifier, whose outputs are its labels' logits; use "
                               "/v1/score, /v1/rerank or /classify", "model")
        encoded = [self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                   else list(p) for p in req.prompts()]
        ids_list = [last_tokens(ids, req.truncate_prompt_tokens, self.engine.max_model_len) for ids in encoded]
        outputs = await self._pooled(ids_list, req.model, req.priority, "input", request, "embd")
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(o.embedding, req.encoding_format)}
                for i, o in enumerate(outputs)]
        tokens = sum(len(ids) for ids in ids_list)
        return {"object": "list", "data": data, "model": req.model or self.config.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, req: ScoreRequest, request: Request) -> Any:
        """vLLM's /v1/score: each pair's score (a cross-encoder's, or two embeddings' cosine: engine/scoring.py)."""
        self._check_pooling("model")
        plan = self._score_plan(req.text_1, req.text_2, "text_1")
        outputs = await self._pooled(plan.prompts, req.model, req.priority, "text_1", request, "score")
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        tokens = sum(len(ids) for ids in plan.prompts)
        return score_reply(plan.scores([o.embedding for o in outputs]), req.model or self.config.model_name, tokens)

    async def rerank(self, req: RerankRequest, request: Request) -> Any:
        """Jina's and Cohere's rerank (vLLM's /v1/rerank): the documents by their score against the query."""
        self._check_pooling("model")
        texts = req.texts()
        plan = self._score_plan(req.query, texts, "documents")
        outputs = await self._pooled(plan.prompts, req.model, req.priority, "documents", request, "rerank")
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        tokens = sum(len(ids) for ids in plan.prompts)
        return rerank_reply(req, texts, plan.scores([o.embedding for o in outputs]),
                            req.model or self.config.model_name, tokens)

    async def classify(self, req: ClassifyRequest, request: Request) -> Any:
        """vLLM's /classify: a sequence classifier's label probabilities for each input."""
        self._check_pooling("model")
        try:
            check_classifier(len(self.engine.labels), "model")
        except ValueError as exc:
            raise RequestError(str(exc), "model") from exc
        ids_list = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts()]
        outputs = await self._pooled(ids_list, req.model, req.priority, "input", request, "classify")
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        return classify_reply([o.embedding for o in outputs], self.engine.labels,
                              req.model or self.config.model_name, sum(len(ids) for ids in ids_list))

    def _check_pooling(self, field: str) -> None:
        if self.engine.config.runner != "pooling":
            raise RequestError(f"{field}: this server generates; embeddings, scores and classes need one started "
                               "with --runner pooling", field)

    def _score_plan(self, text_1: str | list[str], text_2: str | list[str], field: str) -> ScorePlan:
        try:
            return ScorePlan.of(text_1, text_2, self.tokenizer, len(self.engine.labels))
        except ValueError as exc:
            message = str(exc)
            named = message.split(":", 1)[0]
            raise RequestError(message, named if named in ("text_1", "text_2", "score") else field) from exc

    async def _pooled(self, ids_list: list[list[int]], model: str | None, priority: int, field: str,
                      request: Request, prefix: str) -> list[RequestOutput] | None:
        """The pooling runner's outputs for these inputs, each checked against the context and all of them against
        --max-request-tokens (RequestErrors naming `field`); None where the client left."""
        adapter = self.gateway.adapter_for(model)
        params = SamplingParams(max_tokens=1)
        for i, ids in enumerate(ids_list):
            try:
                self.engine.validate(ids, params, embed=True)
            except ValueError as exc:
                raise RequestError(f"{field}.{i}: {exc}", field) from exc
        tokens = sum(len(ids) for ids in ids_list)
        if tokens > self.config.max_request_tokens:
            raise RequestError(f"{field}: this request's inputs hold {tokens} tokens; the limit is "
                               f"{self.config.max_request_tokens} (--max-request-tokens)", field)
        try:
            check_priority(self.engine.config.schedule_policy, priority)
        except ValueError as exc:
            raise RequestError(str(exc), "priority") from exc
        return await until_disconnected(request, self.gateway.collect(
            ids_list, params, f"{prefix}-{uuid.uuid4().hex}", adapter=adapter, priority=priority, embed=True))

    async def responses(self, req: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API, run as a chat completion (serve/responses.py)."""
        try:
            adapter = self.gateway.adapter_for(req.model)
            result = await self.chat_completions(to_chat(req), request)
        except RequestError as exc:
            raise responses_error(exc) from exc
        model = self.config.model_name if adapter is None else adapter.lora_name
        builder = ResponseBuilder(req, model, int(time.time()),
                                  lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)))
        if isinstance(result, StreamingResponse):
            return StreamingResponse(builder.events(result.body_iterator), media_type="text/event-stream")
        if isinstance(result, Response):  # the client left
            return result
        return builder.from_chat(result)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Any:
        adapter = self.gateway.adapter_for(req.model)
        model_name = self.config.model_name if adapter is None else adapter.lora_name
        check_push(self.config.role, req.kv_transfer_params, req.stream)
        top = req.logprobs_asked()
        tools = req.tool_dicts()
        if tools and req.stream and top is not None:
            raise RequestError("logprobs: not supported with tools in a stream (a reply with calls arrives whole)",
                               "logprobs")
        markers = self.gateway.harmony  # a harmony model's replies are read off their token ids
        thinks = self.config.reasoning_parser if markers is None else None
        echo = req.echoed()
        if markers is not None:
            if echo:  # its reply is read off its channels' token ids, not continued text
                raise RequestError("echo: not supported on a gpt-oss (harmony) model", "echo")
            harmony.check_request(req)
            req.constrain_as(harmony.final_channel_constraint)
        elif not req.include_reasoning and thinks is None:
            raise RequestError("include_reasoning: false needs a server started with --reasoning-parser; this one "
                               "returns the reply whole in content", "include_reasoning")
        ids, images = await self.gateway.chat_prompt(req.messages, req.add_generation_prompt, tools,
                                                     req.chat_options())
        if images is not None and req.truncate_prompt_tokens is not None:
            raise RequestError("truncate_prompt_tokens: not supported with images (a cut could split an image)",
                               "truncate_prompt_tokens")
        if images is not None and req.kv_transfer_params is not None:
            raise RequestError("kv_transfer_params: not supported with images (their positions do not travel with "
                               "the KV)", "kv_transfer_params")
        ids = req.truncated(ids, self.engine.max_model_len)
        form = self.gateway.call_format
        token_id = self.tokenizer.tokenizer.token_to_id
        req.use_call_format(form, call_markers(form, token_id))
        marked = (tags(form) if tools and markers is None else ()) + (reasoning_tags(thinks) if thinks else ())
        if are_control_tokens(marked, token_id, self.tokenizer.decode):
            req.skip_special_tokens = False  # as vLLM's parsers do: the tags must reach the parser
        params = self.gateway.admit([ids], req, req.requested_max_tokens(), top, "messages")
        beams = req.beam_search_params(params)
        if images is not None and beams is not None:
            raise RequestError("use_beam_search: not supported with images", "use_beam_search")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        thinks = constrained_parser(thinks, params.structured_outputs is not None)

        def message(c: CompletionOutput) -> tuple[dict[str, Any], bool]:
            """The assistant's message of a reply (its thinking apart, under a reasoning parser or harmony's
            channels), and whether it holds tool calls (parsed from the answer)."""
            if markers is not None:
                reply = harmony.harmony_reply(markers, self.tokenizer, c.token_ids, bool(tools))
                return harmony.chat_message(reply, req.include_reasoning, req.parallel_tool_calls)
            text = c.text
            said: dict[str, Any] = {"role": "assistant"}
            if thinks is not None:
                split = split_reply(text, thinks)
                text = split.content or ""
                if req.include_reasoning:
                    said["reasoning_content"] = split.reasoning
            reply = parse_reply(text, form, tools) if tools else None
            if reply is None or not reply.tool_calls:
                return {**said, "content": echo + text if thinks is None else echo + text or None}, False
            calls = reply.tool_calls if req.parallel_tool_calls else reply.tool_calls[:1]  # at most one, as asked
            return {**said, "content": reply.content, "tool_calls": calls}, True

        def finish(reason: str | None, called: bool) -> str | None:
            return "tool_calls" if called and reason == "stop" else reason

        def logprobs(new_ids: list[int], new_lps) -> dict[str, Any] | None:
            return (_chat_logprobs(self.tokenizer, new_ids, new_lps, top, req.return_tokens_as_token_ids)
                    if top is not None else None)

        if not req.stream:
            outputs = await until_disconnected(request, self.gateway.collect([ids], params, request_id, beams,
                                                                             adapter, req.priority, images=images))
            if outputs is None:
                return Response(status_code=CLIENT_CLOSED)
            (output,) = outputs
            choices = []
            for c in output.outputs:
                reply, called = message(c)
                choices.append({"index": c.index, "message": reply, "logprobs": logprobs(c.token_ids, c.logprobs),
                                "finish_reason": finish(c.finish_reason, called), "stop_reason": c.stop_reason,
                                **({"token_ids": c.token_ids} if req.return_token_ids else {})})
            reply = {"id": request_id, "object": "chat.completion", "created": created,
                     "model": model_name, "choices": choices,
                     "usage": self.gateway.usage([ids], _num_tokens(outputs), outputs)}
            if req.return_token_ids:
                reply["prompt_token_ids"] = ids
            if req.prompt_logprobs is not None:
                reply["prompt_logprobs"] = _prompt_logprobs(self.tokenizer, ids, output.prompt_logprobs,
                                                            req.prompt_logprobs)
            if req.kv_transfer_params is not None:
                reply["kv_transfer_params"] = await self.pusher.push(ids, req.cache_salt, req.kv_transfer_params)
            return reply

        async def events() -> AsyncIterator[str]:
            head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model_name}
            opened: set[int] = set()  # choices whose role went out: with their first token, not before the prefill
            parsers: dict[int, CallStream] = {}  # with tools: each choice's calls, parsed as its text comes
            thinking: dict[int, ReasoningStream] = {}  # with a reasoning parser: each choice's thinking, split off
            channels: dict[int, HarmonyStream] = {}  # a harmony model's: each choice's messages, read off its ids
            num_calls: dict[int, int] = {}  # with tools: each choice's calls sent so far
            final: RequestOutput | None = None
            completion = 0
            held_ids: dict[int, list[int]] = {}  # with return_token_ids: each choice's ids not sent yet
            held = bool(tools) or markers is not None  # text that may go out later: a chunk can have none

            def news(c: CompletionOutput) -> tuple[str, str, list[dict[str, Any]]]:
                """A choice's new thinking, content and whole calls."""
                done = bool(c.finish_reason)
                if markers is not None:
                    stream = channels.setdefault(c.index, HarmonyStream(markers, self.tokenizer, bool(tools)))
                    got = stream.feed(c.token_ids, done)
                    return got.reasoning, got.content, got.calls
                thought, answer, calls = "", c.text, []
                if thinks is not None:  # the thinking apart, as it comes; the answer after it
                    thought, answer = thinking.setdefault(c.index, ReasoningStream(thinks)).feed(c.text, done)
                if tools:  # content as it comes; each call whole, once its closing tag has come
                    answer, calls = parsers.setdefault(c.index, CallStream(form, tools)).feed(answer, done)
                return thought, answer, calls

            if req.return_token_ids:  # once, before any choice
                yield sse({**head, "choices": [], "prompt_token_ids": ids})
            async for _, out in guard(self.gateway.run([ids], params, request_id, beams, OutputKind.DELTA, adapter,
                                                       req.priority, images=images)):
                if isinstance(out, RequestError):
                    yield sse(out.body())
                    break
                final = out
                completion += _num_tokens([out])
                if out.prompt_logprobs is not None and req.prompt_logprobs is not None:  # once, before any choice
                    yield sse({**head, "choices": [], "prompt_logprobs": _prompt_logprobs(
                        self.tokenizer, ids, out.prompt_logprobs, req.prompt_logprobs)})
                for c in out.outputs:
                    held_ids.setdefault(c.index, []).extend(c.token_ids)
                    thought, text, calls = news(c)
                    thought = thought if req.include_reasoning else ""
                    sent = num_calls.get(c.index, 0)
                    calls = calls if req.parallel_tool_calls else calls[:max(0, 1 - sent)]
                    if held and not text and not calls and not thought and not c.finish_reason:
                        continue
                    delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
                    if text or not (held or c.finish_reason or thought):
                        delta["content"] = text
                    if calls:
                        delta["tool_calls"] = [{"index": sent + k, **call} for k, call in enumerate(calls)]
                        num_calls[c.index] = sent + len(calls)
                    if c.index not in opened:  # OpenAI opens every choice with the role (and echo's text)
                        opened.add(c.index)
                        delta = {"role": "assistant", "content": None if tools else "", **delta}
                        if echo:
                            delta["content"] = echo + (delta["content"] or "")
                    item = {"index": c.index, "delta": delta,
                            "logprobs": None if tools else logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish(c.finish_reason, num_calls.get(c.index, 0) > 0)}
                    if req.return_token_ids:  # what came since this choice's last chunk (tools hold some back)
                        item["token_ids"] = held_ids.pop(c.index)
                    so_far = {"usage": self.gateway.usage_so_far([ids], completion)} if req.continuous_usage else {}
                    yield sse({**head, "choices": [item], **so_far})
            if req.include_usage and final is not None:
                yield sse({**head, "choices": [], "usage": self.gateway.usage([ids], completion, [final])})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


# Characters that JSON leaves raw but that str.splitlines() -- and so clients that split an event stream
# with it, httpx's aiter_lines among them -- takes for line ends: escaped, an event stays on one line.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event, on one line whatever the text holds."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or their float32 little-endian bytes in base64 (its SDK's default)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


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


def _best(samples: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples of highest cumulative logprob, indexed 0..n-1 in that order."""
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    return [dataclasses.replace(c, index=k) for k, c in enumerate(ranked)]


def _without_generation(c: CompletionOutput) -> CompletionOutput:
    """An echo-only choice (max_tokens 0): the one token generated to finish the prompt is not shown."""
    return CompletionOutput(c.index, "", [], c.finish_reason and "length", None, [] if c.logprobs is not None else None)


def _top(entry: dict[int, float] | None, n: int, token: int) -> dict[int, float] | None:
    """A prompt token's entry cut to its n likeliest alternatives and the token itself."""
    if entry is None or len(entry) <= n:
        return entry
    kept = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:n])
    kept[token] = entry[token]
    return kept


def _token_names(tokenizer: RidgeTokenizer, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or (return_tokens_as_token_ids) "token_id:<id>", which stays apart
    from every other token where texts collide or a token is part of a character."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else tokenizer.token_text


def _completion_logprobs(tokenizer: RidgeTokenizer, ids: list[int], logprobs: list[dict[int, float] | None] | None,
                         offset: int, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset (an echoed
    prompt's first token has no logprob: null in both lists, as OpenAI's); as_ids: tokens named by their ids, the
    offsets still those of their text."""
    name = _token_names(tokenizer, as_ids)
    entries = logprobs or [{} for _ in ids]
    offsets, position = [], offset
    for token_id in ids:
        offsets.append(position)
        position += len(tokenizer.token_text(token_id))
    return {"tokens": [name(t) for t in ids],
            "token_logprobs": [None if e is None else e.get(t) for t, e in zip(ids, entries, strict=True)],
            "top_logprobs": [None if e is None else {name(k): v for k, v in e.items()} for e in entries],
            "text_offset": offsets}


def _prompt_logprobs(tokenizer: RidgeTokenizer, ids: list[int], entries: list[dict[int, float] | None],
                     n: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, its entry keyed by token id (the first token's is null)."""
    return [None if e is None else {str(k): {"logprob": v, "decoded_token": tokenizer.token_text(k)}
                                    for k, v in _top(e, n, t).items()} for e, t in zip(entries, ids, strict=True)]


def _chat_logprobs(tokenizer: RidgeTokenizer, ids: list[int], logprobs: list[dict[int, float]] | None,
                   top: int, as_ids: bool = False) -> dict[str, Any]:
    """as_ids: tokens named by their ids; their bytes are still their text's."""
    name = _token_names(tokenizer, as_ids)

    def item(token_id: int, value: float) -> dict[str, Any]:
        return {"token": name(token_id), "logprob": value, "bytes": list(tokenizer.token_text(token_id).encode())}

    content = []
    for token_id, entry in zip(ids, logprobs or [{} for _ in ids], strict=True):
        alternatives = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(token_id, entry.get(token_id, float("nan"))),
                        "top_logprobs": [item(k, v) for k, v in alternatives]})
    return {"content": content}


