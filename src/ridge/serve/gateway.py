"""Taking an API request through the engine: admission (every limit checked before anything is queued),
running its prompts, collecting or streaming their outputs, and the engine's errors as API errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request

from ridge.config import EngineConfig
from ridge.engine.async_engine import AsyncEngine
from ridge.engine.beam_search import BeamSearchParams, beam_search_async
from ridge.engine.engine_core import LoadAdapter, UnloadAdapter
from ridge.engine.outputs import CompletionOutput, OutputKind, RequestOutput
from ridge.engine.scheduler import check_priority
from ridge.engine.speculative import SpeculationStats
from ridge.engine.supervision import EngineDead, EngineRestarting, QueueFull, RequestFailed, ShuttingDown
from ridge.lora.request import LoRARequest
from ridge.multimodal.messages import split_images
from ridge.multimodal.placement import ImagePrompt
from ridge.sampling_params import SamplingParams, StructuredOutputsParams
from ridge.serve import harmony
from ridge.serve.harmony import HarmonyTokens
from ridge.serve.protocol import ChatMessage, RequestError, SamplingFields, plain_messages
from ridge.serve.reasoning import PARSERS as REASONING_PARSERS
from ridge.serve.tools import PARSERS, call_format, supports_tools, template_messages
from ridge.tokenizer import ChatOptions

T = TypeVar("T")
ENGINE_ERRORS = (QueueFull, ShuttingDown, EngineDead, RequestFailed, ValueError)


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
    # a request's own chat_template runs (sandboxed) only when the operator allows it: a template is code
    trust_request_chat_template: bool = False
    # how the model's tool calls are parsed: "auto" (the format its chat template shows), "hermes", "qwen3_coder",
    # "pythonic" (serve/tools.py), or "openai" (gpt-oss's harmony channels, which auto reads on such a model:
    # serve/harmony.py)
    tool_call_parser: str = "auto"
    # a reasoning model's thinking split into reasoning_content: "deepseek_r1" or "qwen3" (serve/reasoning.py); None:
    # the reply whole in content. A harmony model's (gpt-oss) is always split, "openai_gptoss" or None
    reasoning_parser: str | None = None
    # disaggregated prefill: "prefill" pushes a prompt's KV where a request's kv_transfer_params say, "decode" takes
    # it in (POST /kv/import); "both" (the default) does neither (serve/kv_transfer.py)
    role: str = "both"
    # vLLM's runtime LoRA updating (its VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter, which load a directory of the server's filesystem into the engine
    allow_runtime_lora_updating: bool = False
    # vLLM's: image_url parts may name files of this machine under this directory (None: no local files are read)
    allowed_local_media_path: Path | None = None

    def __post_init__(self) -> None:
        parsers = (*REASONING_PARSERS, harmony.REASONING_PARSER)
        if self.reasoning_parser is not None and self.reasoning_parser not in parsers:
            raise ValueError(f"reasoning_parser: {self.reasoning_parser!r} is not one of {', '.join(parsers)}")

    def check_engine(self, engine: EngineConfig) -> None:
        """Refuse, before the engine loads, what asks for an engine feature that is off."""
        if self.allow_runtime_lora_updating and not engine.enable_lora:
            raise ValueError("allow_runtime_lora_updating: loads LoRA adapters into an engine started with "
                             "--enable-lora; add it")

    def check_parsers(self, harmony_tokens: HarmonyTokens | None) -> None:
        """Refuse, at start, parsers that do not read the model's replies: harmony's on a model without its
        markers, the tag parsers on a model that writes harmony channels."""
        reads_harmony = {"reasoning_parser": harmony.REASONING_PARSER, "tool_call_parser": harmony.TOOL_CALL_PARSER}
        for name, parser in reads_harmony.items():
            given = getattr(self, name)
            if harmony_tokens is None and given == parser:
                raise ValueError(f"{name}: {parser} reads gpt-oss's harmony channels; this model's vocabulary has no "
                                 "<|channel|> / <|message|> tokens")
            if harmony_tokens is not None and given not in (None, "auto", parser):
                raise ValueError(f"{name}: {given} reads tags this model does not write: its replies are harmony "
                                 f"channels (gpt-oss), read by {parser}, which the server uses by default")


class Gateway:
    """The routes' way into the engine, under the server's limits."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        # a model that writes harmony (gpt-oss): its chat replies are read off their token ids (serve/harmony.py)
        self.harmony = HarmonyTokens.of(self.tokenizer.tokenizer.token_to_id)
        config.check_parsers(self.harmony)
        # the LoRA adapters the engine loaded at start (and at run time), which clients ask for by name as `model`
        self.adapters = {r.lora_name: r for r in LoRARequest.from_modules(engine.config.lora_modules)}
        # the requests running on each adapter, from their submission to their end: one is not unloaded under them
        self._adapter_users: Counter[str] = Counter()
        self._adapter_ids = max((a.lora_int_id for a in self.adapters.values()), default=0)  # the last given

    @property
    def call_format(self) -> str:
        """How the model's tool calls are parsed (serve/tools.py's call_format; Hermes' where the template shows
        none: such a model's tools are refused before this is asked)."""
        return call_format(self.tokenizer.info.chat_template, self.config.tool_call_parser) or "hermes"

    def adapter_for(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names; None for the base model (or no name); 404 for another."""
        if name is None or name == self.config.model_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(f"`{n}`" for n in [self.config.model_name, *self.adapters])
            raise RequestError(f"The model `{name}` does not exist; this server serves {served}.", "model", 404,
                               "NotFoundError")
        return adapter

    def check_model(self, name: str | None) -> None:
        self.adapter_for(name)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter into the engine and serve it as `name` (a 400 naming what does not fit)."""
        if name == self.config.model_name or name in self.adapters:
            raise RequestError(f"lora_name: {name!r} is already served; unload it first", "lora_name")
        self._adapter_ids += 1  # never reused: the engine knows an adapter by its name and id
        request = LoRARequest(name, self._adapter_ids, path)
        try:
            await asyncio.to_thread(self.engine.update_adapters, LoadAdapter(request))
        except ValueError as exc:  # its message opens with the field it names (lora_path, max_lora_rank, ...)
            raise RequestError(str(exc), str(exc).partition(":")[0]) from exc
        except (EngineDead, ShuttingDown) as exc:
            raise engine_errors(exc) from exc
        self.adapters[name] = request

    async def unload_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter and free it in the engine (404 for a name not served; 400 while in use)."""
        if name not in self.adapters:
            raise RequestError(f"lora_name: no adapter {name!r} is served", "lora_name", 404, "NotFoundError")
        if self._adapter_users[name]:  # some may not have reached the engine yet, which would load it again
            raise RequestError(f"lora_name: {name!r} is in use by {self._adapter_users[name]} requests still "
                               "running or waiting; unload it after they finish", "lora_name")
        request = self.adapters.pop(name)  # no new request reaches it from here on
        try:
            await asyncio.to_thread(self.engine.update_adapters, UnloadAdapter(name))
        except (ValueError, EngineDead, ShuttingDown) as exc:  # still loaded: served again
            self.adapters[name] = request
            raise (RequestError(str(exc), "lora_name") if isinstance(exc, ValueError) else engine_errors(exc)) from exc

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, options: ChatOptions | None = None
                          ) -> tuple[list[int], ImagePrompt | None]:
        """The conversation's token ids, and its images placed in them where it has image parts (fetched, decoded
        and preprocessed off the event loop; the ids are then the placed images' token_ids)."""
        plain, sources = split_images(self._template_messages(messages))
        ids = self._render(plain, add_generation_prompt, tools, options)
        if not sources:
            return ids, None
        try:
            images = await asyncio.to_thread(self.engine.images.place, ids, sources,
                                             self.config.allowed_local_media_path or False)
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from exc
        return images.token_ids, images

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None = None, options: ChatOptions | None = None) -> list[int]:
        """The conversation's token ids (an image part's placeholder where it has one: /tokenize's count is of the
        template's text); with tools, rendered with them (a template with no tool-call format ridge parses refuses
        them), each tool's parameters checked as a JSON schema."""
        return self._render(split_images(self._template_messages(messages))[0], add_generation_prompt, tools,
                            options)

    def _template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        rendered = template_messages(plain_messages(messages, images=self.engine.images is not None))
        return harmony.template_thinking(rendered) if self.harmony is not None else rendered

    def _render(self, rendered: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, options: ChatOptions | None) -> list[int]:
        """Template messages' token ids; with tools, rendered with them (a template with no tool-call format
        ridge parses refuses them), each tool's parameters checked as a JSON schema."""
        if options is not None and options.template is not None and not self.config.trust_request_chat_template:
            raise RequestError("chat_template: a request's own chat template runs only on a server started with "
                               "--trust-request-chat-template; this one uses the model's", "chat_template")
        if tools:
            template = self.tokenizer.info.chat_template or ""
            # a harmony model's calls come on its commentary channel, which serve/harmony.py reads
            readable = "tools" in template if self.harmony is not None else supports_tools(
                template, self.config.tool_call_parser)
            if not readable:
                raise RequestError("tools: this model's chat template " + (
                    "does not render tools" if "tools" not in template else
                    "has no tool-call format ridge can parse (Hermes' <tool_call> tags, Qwen3-Coder's <function=...>, "
                    "LFM2's pythonic <|tool_call_start|>, GLM-4.5's <arg_key>, MiniMax-M2's <minimax:tool_call>; "
                    f"--tool-call-parser {' / '.join(PARSERS[1:])} parses them anyway)"), "tools")
            for i, tool in enumerate(tools):
                parameters = tool["function"].get("parameters")
                try:
                    self.engine.grammars.grammar(StructuredOutputsParams(json=parameters or {"type": "object"}))
                except ValueError as exc:
                    raise RequestError(f"tools.{i}.function.parameters: {str(exc).split(': ', 1)[1]}",
                                       f"tools.{i}.function.parameters") from exc
        try:
            return self.tokenizer.encode_chat(rendered, add_generation_prompt, tools, options)
        except ValueError as exc:
            message = str(exc)
            field = message.split(":")[0]
            raise RequestError(message, field if field in ("chat_template", "chat_template_kwargs",
                                                           "continue_final_message", "reasoning_effort", "documents")
                               else "messages") from exc

    def admit(self, prompts: list[list[int]], fields: SamplingFields, requested: int | None,
              logprobs: int | None, what: str) -> SamplingParams:
        """Check every prompt and the sampling fields; return the params. Raises before queuing anything."""
        samples = fields.num_samples
        if isinstance(samples, int) and samples > self.config.max_n:
            name = "n" if samples == fields.n else "best_of"
            raise RequestError(f"{name}: {samples} samples asked for; the limit is {self.config.max_n} (--max-n)",
                               name)
        longest, max_model_len = max(len(p) for p in prompts), self.engine.max_model_len
        if requested is not None and longest + requested > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{longest + requested} tokens ({longest} in the {what}, {requested} for the completion). "
                "Please reduce the length of the prompt or completion.", what)
        max_tokens = requested if requested is not None else max(1, max_model_len - longest)
        params = fields.sampling_params(max_tokens, logprobs)
        try:
            check_priority(self.engine.config.schedule_policy, fields.priority)
        except ValueError as exc:
            raise RequestError(str(exc), "priority") from exc
        for ids in prompts:
            try:
                self.engine.validate(ids, params)
            except ValueError as exc:
                message = str(exc)
                field = fields.structured_field
                if message.startswith("structured_outputs") and field not in (None, "structured_outputs"):
                    message = f"{field}:{message.split(':', 1)[1]}"  # the field this request named it with
                raise RequestError(message, what if message.startswith("prompt") else message.split(":")[0]) from exc
        work = sum(len(p) for p in prompts) + len(prompts) * params.n * max_tokens
        if work > self.config.max_request_tokens:
            raise RequestError(
                f"max_tokens: this request's work is {work} tokens (prompt + n x max_tokens = "
                f"{sum(len(p) for p in prompts)} + {len(prompts) * params.n} x {max_tokens}); the limit is "
                f"{self.config.max_request_tokens} (--max-request-tokens). Lower n or max_tokens.", "max_tokens")
        try:  # here, not only in generate(): a stream's status line goes out before generate() runs
            self.engine.check_admission(len(prompts) * params.n, work)
        except (QueueFull, ShuttingDown, EngineDead) as exc:
            raise engine_errors(exc) from exc
        return params

    @contextlib.contextmanager
    def _using(self, adapter: LoRARequest | None) -> Iterator[None]:
        """Hold `adapter` while a request runs on it; a 404 where it was unloaded since the request named it.
        Checked and counted with no await between (the event loop's one thread): unload_adapter sees every request
        that will reach the engine with it."""
        if adapter is None:
            yield
            return
        if self.adapters.get(adapter.lora_name) is not adapter:
            raise RequestError(f"The model `{adapter.lora_name}` does not exist; it was unloaded.", "model", 404,
                               "NotFoundError")
        self._adapter_users[adapter.lora_name] += 1
        try:
            yield
        finally:
            self._adapter_users[adapter.lora_name] -= 1

    async def run(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                  beams: BeamSearchParams | None = None, kind: OutputKind = OutputKind.FINAL,
                  adapter: LoRARequest | None = None, priority: int = 0, embed: bool = False,
                  images: ImagePrompt | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts of one API request, interleaved as they come: (prompt index, output).
        A beam search yields each prompt's final output only, its params.n best beams as the choices; embed: each
        prompt's embedding (a pooling runner), params unread; images: the one prompt's images, placed in it."""
        if images is not None and (beams is not None or len(prompts) != 1):
            raise RequestError("use_beam_search: not supported with images", "use_beam_search")
        with self._using(adapter):
            async for item in self._run(prompts, params, request_id, beams, kind, adapter, priority, embed, images):
                yield item

    async def _run(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                   beams: BeamSearchParams | None, kind: OutputKind, adapter: LoRARequest | None,
                   priority: int, embed: bool, images: ImagePrompt | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        if beams is not None:
            results = await beam_search_async(self.engine, prompts, beams, request_id, adapter, priority)
            for i, result in enumerate(results):
                choices = [CompletionOutput(j, h.text, h.token_ids, "stop" if h.finished else "length",
                                            cumulative_logprob=h.cumulative_logprob)
                           for j, h in enumerate(result.sequences[:params.n])]
                yield i, RequestOutput(f"{request_id}-{i}", None, result.prompt_token_ids, choices, True)
            return
        if len(prompts) == 1:  # the common case, without a task and a queue in between
            outputs = self.engine.generate(prompts[0], params, f"{request_id}-0", kind, adapter, priority, embed,
                                           images)
            async with contextlib.aclosing(outputs):
                async for out in outputs:  # aclosing: a disconnect aborts the request now, not at garbage collection
                    yield 0, _unless_aborted(out)
            return
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for out in self.engine.generate(ids, params, f"{request_id}-{i}", kind, adapter, priority,
                                                      embed):
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

    async def collect(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                      beams: BeamSearchParams | None = None, adapter: LoRARequest | None = None,
                      priority: int = 0, embed: bool = False, images: ImagePrompt | None = None
                      ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in self.run(prompts, params, request_id, beams, adapter=adapter, priority=priority,
                                         embed=embed, images=images):
                finals[i] = out
        except ENGINE_ERRORS as exc:
            raise engine_errors(exc) from exc
        return finals  # type: ignore[return-value]

    @staticmethod
    def usage_so_far(prompts: list[list[int]], completion: int) -> dict[str, int]:
        """A stream chunk's usage (continuous_usage_stats): the request's prompt tokens and its tokens so far."""
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    @staticmethod
    def usage(prompts: list[list[int]], completion: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The usage block: completion tokens counted by the caller (a stream's outputs carry only news)."""
        result: dict[str, Any] = {**Gateway.usage_so_far(prompts, completion), "prompt_tokens_details": {
            "cached_tokens": sum(o.num_cached_tokens for o in outputs)}}
        if any("kv_evicted_tokens" in o.metrics for o in outputs):  # an evicting engine: what it let go of
            result["kv_evicted_tokens"] = sum(int(o.metrics["kv_evicted_tokens"]) for o in outputs)
        drafts = sum(o.metrics.get("spec_drafts") or 0 for o in outputs)
        if drafts:  # speculative decoding ran for this request: what the drafter achieved on it
            spec = SpeculationStats(drafts, sum(o.metrics["spec_draft_tokens"] for o in outputs),
                                    sum(o.metrics["spec_accepted_tokens"] for o in outputs))
            result["spec_decode"] = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                                     "num_accepted_tokens": spec.num_accepted_tokens,
                                     "acceptance_rate": spec.acceptance_rate,
                                     "mean_accepted_length": spec.mean_accepted_length}
        return result


def engine_errors(exc: Exception) -> RequestError:
    """The API error for one of the engine's (anything else is raised again)."""
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


async def guard(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
    """A stream's failure becomes an error event: its HTTP status has already been sent (the engine's errors, and
    the gateway's own, such as an adapter unloaded between the request's checks and its start)."""
    try:
        async for item in outputs:
            yield item
    except ENGINE_ERRORS as exc:
        yield -1, engine_errors(exc)
    except RequestError as exc:
        yield -1, exc


def _unless_aborted(out: RequestOutput) -> RequestOutput:
    """A request the server itself aborted (its client is still there: the server is shutting down), or that the
    engine could not finish, ends with an error, never as a reply cut short."""
    if any(c.finish_reason == "abort" for c in out.outputs):
        raise ShuttingDown("the server is shutting down; this request was stopped before it finished")
    if any(c.finish_reason == "error" for c in out.outputs):
        raise RequestFailed("structured outputs: the grammar engine (llguidance) refused a token its own mask "
                            "allowed, and the reply was cut there (the server's log names the token)")
    return out


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
