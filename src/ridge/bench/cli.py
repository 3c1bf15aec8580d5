"""`ridge bench latency|throughput`: ridge and its peers on the same requests, side by side, in one run."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ridge.bench import workloads
from ridge.bench.capacity import add_capacity_parser
from ridge.bench.context import add_context_parser
from ridge.bench.embed import add_embed_parser
from ridge.bench.eviction import add_eviction_parser
from ridge.bench.invariance import add_invariance_parser
from ridge.bench.kv_formats import add_kv_parser
from ridge.bench.lora import add_lora_parser
from ridge.bench.priority import add_priority_parser
from ridge.bench.quant import add_quant_parser
from ridge.bench.report import add_report_parser
from ridge.bench.router import add_router_parser
from ridge.bench.serve import add_serve_parser
from ridge.bench.soak import add_soak_parser
from ridge.bench.structured import add_structured_parser
from ridge.bench.tensor_parallel import add_tp_parser
from ridge.bench.vision import add_vision_parser
from ridge.linear import model_weight_bytes
from ridge.models.random_weights import hf_config, is_random
from ridge.models.spec import ModelSpec
from ridge.plan import arithmetic, roofline

DRIVER = Path(__file__).with_name("peer_driver.py")
PEERS = ("hf", "vllm", "llamacpp")


@dataclass
class EngineResult:
    engine: str
    figures: dict[str, float] = field(default_factory=dict)
    note: str = ""
    error: str | None = None


# ---- peers ------------------------------------------------------------------------------------------------
def peers_dir() -> Path:
    return Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "ridge-peers"))


def find_peers(given: list[str], all_installed: bool) -> dict[str, str]:
    """name -> python: HF always (its venv, else this interpreter), the others when given or --all-peers."""
    found: dict[str, str] = {}
    for item in given:
        name, _, python = item.partition("=")
        if name not in PEERS or not python:
            raise ValueError(f"--peer: expected NAME=PYTHON with NAME one of {', '.join(PEERS)}, got {item!r}")
        found[name] = str(Path(python).expanduser())
    for name in PEERS:
        venv_python = peers_dir() / name / "bin" / "python"
        if name not in found and venv_python.exists() and (all_installed or name == "hf"):
            found[name] = str(venv_python)
    if "hf" not in found:
        found["hf"] = sys.executable  # transformers is one of ridge's test dependencies
    return found


def run_peer(name: str, python: str, job: dict[str, Any], timeout: float) -> EngineResult:
    log_dir = Path(tempfile.gettempdir()) / "ridge-bench-logs"
    log_dir.mkdir(exist_ok=True)
    log_path = log_dir / f"{name}-{job['mode']}.log"
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        print(f"[bench] running {name} ({python}) ... log: {log_path}", file=sys.stderr, flush=True)
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run([python, str(DRIVER), name, str(job_path), str(out_path)],
                                      stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return EngineResult(name, error=f"{type(exc).__name__}: {exc}")
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            return EngineResult(name, error=f"exit {proc.returncode}: {' | '.join(tail)}")
        data = json.loads(out_path.read_text())
    note = data.pop("note", "")
    return EngineResult(name, figures=data, note=note)


def hf_export_dir(gguf: Path, dtype: str, python: str) -> Path:
    """vLLM reads HF-format directories: export the GGUF once (dequantized) with HF transformers."""
    from ridge.hub import ridge_home

    target = ridge_home() / "hf" / f"{gguf.stem}-{dtype}"
    if not (target / "config.json").exists():
        result = run_peer("hf", python, {"mode": "export", "gguf": str(gguf), "hf_dir": str(target),
                                         "dtype": dtype, "requests": []}, timeout=1800)
        if result.error:
            raise RuntimeError(f"exporting {gguf.name} for vLLM failed: {result.error}")
    return target


# ---- ridge ------------------------------------------------------------------------------------------------
def _ridge(args: argparse.Namespace):
    from ridge import LLM
    from ridge.flags import engine_kwargs

    return LLM(args.model, **engine_kwargs(args))


def _greedy(n: int):
    from ridge import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ridge_latency(args: argparse.Namespace, llm, ids: list[int]) -> EngineResult:
    def run_one(prompt: list[int], n: int) -> tuple[float, float]:
        """Seconds to the first token and for all n, of one run (the engine's clock from the request's arrival)."""
        (out,) = llm.generate(prompt, _greedy(n))
        return out.metrics["ttft_s"], out.metrics["e2e_s"]

    from ridge.bench.peer_driver import measure_latency

    figures = measure_latency(run_one, {"requests": [{"prompt_ids": ids, "max_tokens": args.output_len}],
                                 "repeats": args.repeats})
    llm.engine.check_integrity()
    return EngineResult("ridge", figures, note=llm.engine.loaded.weight_format)


def _warm_up(llm, requests: list[workloads.Request]) -> None:
    """The workload's shape on other tokens (each prompt reversed: no prefix in common with the measured run's),
    prompts enough to fill more than one step, so that the kernels of chunked and mixed steps are compiled (on
    CUDA, Triton compiles a kernel at its first launch, for seconds) before the clock starts."""
    budget = llm.engine.config.max_num_batched_tokens
    prompts: list[list[int]] = []
    for request in requests[:64]:
        prompts.append(request.prompt_ids[::-1])
        if sum(map(len, prompts)) > budget:
            break
    llm.generate(prompts, _greedy(4))


def ridge_throughput(args: argparse.Namespace, requests: list[workloads.Request], llm) -> EngineResult:
    _warm_up(llm, requests)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], [_greedy(r.max_tokens) for r in requests], use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(r.max_tokens for r in requests)
    assert produced == expected, f"ridge produced {produced} tokens, the workload asks {expected}"
    llm.engine.check_integrity()
    return EngineResult("ridge", {"elapsed_s": elapsed}, note=llm.engine.loaded.weight_format)


# ---- commands -------------------------------------------------------------------------------------------
def _peer_job(args, mode: str, requests: list[dict], gguf: Path | None, dtype: str) -> dict[str, Any]:
    return {"mode": mode, "gguf": str(gguf), "dtype": dtype, "requests": requests, "repeats": args.repeats,
            "batch_size": args.hf_batch_size, "threads": args.num_threads, "device": args.device}


def random_gguf_for(spec: ModelSpec, seed: int, block_type: str | None = None) -> Path:
    """A float16 GGUF of `random:NAME`'s weights for the peers (or its matrices in a GGUF block format:
    random_gguf.BLOCK_TYPES), written once under ~/.cache/ridge/random-gguf with the vocabulary of a pulled GGUF
    of the same size (ValueError naming what is missing)."""
    from ridge.bench.random_gguf import WRITER_VERSION, write_random_gguf
    from ridge.hub import ALIASES, ridge_home

    folder = ridge_home() / "random-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    # the file is what this spec and this writer make: a changed preset or writer never reuses an old file
    digest = hashlib.sha1(f"{spec!r} writer {WRITER_VERSION}".encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.name.removeprefix("random:"))
    path = folder / f"{name}-seed{seed}-{digest}{'-' + block_type if block_type else ''}.gguf"
    if path.exists():
        return path
    vocabularies = [p for alias in ALIASES if (p := _pulled(alias)) is not None and _vocab_size(p) == spec.vocab_size]
    if not vocabularies:
        raise ValueError(f"llama.cpp needs a vocabulary of {spec.vocab_size} tokens: pull a GGUF with one "
                         f"(Qwen's 151,936: ridge pull qwen2.5-coder-0.5b) or set vocab_size to a pulled one's")
    # its float16 weights (a block type's are fewer): refused up front rather than a disk filled part way
    needed, free = arithmetic.weight_bytes(spec, "fp16"), shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(f"model: a GGUF of {spec.name} for the peers needs ~{needed / 1e9:.1f} GB in {folder}, which "
                         f"has {free / 1e9:.1f} GB free (its older files can go: they are written again when needed)")
    print(f"[bench] writing {spec.name} as a GGUF for the peers (llama.cpp reads it, vLLM its HF export): {path}",
          file=sys.stderr)
    tmp = path.with_suffix(".partial")
    try:
        write_random_gguf(spec, tmp, vocabularies[0], seed, block_type=block_type)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a file cut short is not left behind
        raise
    tmp.rename(path)
    _free_device_memory("cpu")  # the weights drawn for the file, resident until trimmed, would crowd the peer's
    return path


def _pulled(alias: str) -> Path | None:
    from ridge.hub import resolve

    try:
        return resolve(alias, download=False)
    except (ValueError, FileNotFoundError):
        return None


def _vocab_size(gguf: Path) -> int:
    from ridge.models.gguf_file import read_gguf

    return len(read_gguf(gguf).fields["tokenizer.ggml.tokens"])


def _run_peers(args, mode: str, requests: list[dict], gguf: Path | None, dtype: str,
               spec: ModelSpec) -> list[EngineResult]:
    """gguf: the model's file; None for a random model, which HF builds from its shape (random weights too),
    llama.cpp reads from a GGUF of ridge's random weights written for it (bench/random_gguf.py), and vLLM from
    that GGUF exported by HF transformers to an HF directory (where HF reads the architecture's GGUFs)."""
    if gguf is None:
        results = []
        if "hf" not in (args.skip_peer or []):
            job = {**_peer_job(args, mode, requests, None, dtype), "hf_config": hf_config(spec)}
            results.append(run_peer("hf", sys.executable, job, timeout=args.peer_timeout))
        found = find_peers(args.peer or [], args.all_peers)
        for name in PEERS:
            if name == "hf" or name in (args.skip_peer or []):
                continue
            if name not in found:
                results.append(EngineResult(name, error=f"not run (--peer {name}=PYTHON or --all-peers)"))
                continue
            try:
                # the engine's weight seed (EngineConfig.seed); under mxfp4, the experts in MXFP4 blocks as ridge
                # holds them (llama.cpp's gpt-oss files' form)
                block_type = "MXFP4" if getattr(args, "quantization", None) == "mxfp4" else None
                path = random_gguf_for(spec, seed=0, block_type=block_type)
                job = _peer_job(args, mode, requests, path, dtype)
                if name == "vllm":
                    job["hf_dir"] = str(hf_export_dir(path, dtype, found.get("hf", sys.executable)))
            except (ValueError, RuntimeError) as exc:
                results.append(EngineResult(name, error=str(exc)))
                continue
            results.append(run_peer(name, found[name], job, timeout=args.peer_timeout))
        return results
    results = []
    found = find_peers(args.peer or [], args.all_peers)  # HF stays found: it exports the model vLLM reads
    peers = {name: python for name, python in found.items() if name not in (args.skip_peer or [])}
    for name, python in peers.items():
        job = _peer_job(args, mode, requests, gguf, dtype)
        if name == "vllm":
            try:
                job["hf_dir"] = str(hf_export_dir(gguf, dtype, found["hf"]))
            except RuntimeError as exc:
                results.append(EngineResult(name, error=str(exc)))
                continue
        result = run_peer(name, python, job, timeout=args.peer_timeout)
        if name == "llamacpp" and result.error and result.error.startswith("exit -11"):
            print("[bench] llama.cpp crashed (SIGSEGV); retrying without AMX/repacked weights", file=sys.stderr)
            result = run_peer(name, python, {**job, "no_extra_bufts": True}, timeout=args.peer_timeout)
        results.append(result)
    for name in PEERS:
        if name not in peers and name not in (args.skip_peer or []):
            results.append(EngineResult(name, error=f"not installed (../shared/peers/install.sh {name}, "
                                                    f"then --peer {name}=PYTHON or --all-peers)"))
    return results


def cmd_latency(args: argparse.Namespace) -> int:
    from ridge.hub import resolve

    if args.speculate or args.draft_model:
        from ridge.bench.speculative import cmd_speculative

        return cmd_speculative(args, _ridge(args))
    print(f"[bench] measuring the read bandwidth of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(dtypes=(), device=args.device)
    if args.enable_prefix_caching:  # every run repeats the prompt: with the cache on, prefill would be a hit
        print("[bench] latency runs without the prefix cache (each engine prefills the whole prompt every run)",
              file=sys.stderr)
        args.enable_prefix_caching = False
    llm = _ridge(args)
    ids = _latency_prompt(args, llm.tokenizer)
    ridge_result = ridge_latency(args, llm, ids)
    busy = None
    if args.device.startswith("cuda"):
        from ridge.plan.doctor import time_shares

        _, busy = time_shares(llm, ids, args.output_len, _greedy)
        ridge_result.figures["gpu_busy_fraction"] = busy
    gguf = None if is_random(args.model) else resolve(args.model)
    dtype = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    bytes_per_token = model_weight_bytes(llm.engine.loaded.model)
    spec = llm.engine.loaded.spec
    del llm
    _free_device_memory(args.device)
    roof = roofline.remeasured(roof, args.device)
    results = [ridge_result]
    if not args.no_peers:
        results += _run_peers(args, "latency", [{"prompt_ids": ids, "max_tokens": args.output_len}], gguf, dtype,
                              spec)
    ridge_fig = ridge_result.figures
    ridge_fig["weight_gb_s"] = bytes_per_token * ridge_fig["decode_tok_s"] / 1e9
    ridge_fig["roofline_fraction"] = ridge_fig["weight_gb_s"] / roof.read_gb_s
    report = {"benchmark": "latency", "model": args.model, "device": _device_name(args.device),
              "prompt_tokens": len(ids), "new_tokens": args.output_len,
              "machine": {"read_gb_s": roof.read_gb_s}, "weight_bytes_per_token": bytes_per_token,
              "results": [asdict(r) for r in results]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\nbatch-1 latency: {args.model}, {len(ids)}-token prompt, {args.output_len} new tokens, "
          f"median of {args.repeats}; {_device_name(args.device)}, read bandwidth {roof.read_gb_s:.1f} GB/s")
    _print_table(results, [("prefill tok/s", "prefill_tok_s", 14, ".0f"), ("decode tok/s", "decode_tok_s", 13, ".1f")],
                 ratio_key="decode_tok_s")
    print(f"ridge decode reads {bytes_per_token / 1e6:.0f} MB of weights per token: "
          f"{ridge_fig['weight_gb_s']:.1f} GB/s = {100 * ridge_fig['roofline_fraction']:.0f}% of the measured "
          f"read bandwidth")
    if busy is not None:
        print(f"the GPU is busy {100 * busy:.0f}% of a decode step, idle {100 * (1 - busy):.0f}% (waiting on the host)")
    return 0


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return "this machine's CPU"


def _free_device_memory(device: str) -> None:
    """Give the engine's memory back before a peer loads its own copy of the model (or a GGUF of it is drawn and
    written): its objects refer to each other, so dropping the last name does not free them until a collection,
    and the freed weights stay resident on the heap until it is trimmed."""
    import gc

    from ridge.engine.native_memory import trim_heap

    gc.collect()
    trim_heap()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _latency_prompt(args: argparse.Namespace, tok) -> list[int]:
    text = ("You are a storyteller. Write a long, detailed story about a lighthouse keeper who finds a message "
            "in a bottle, describing the sea, the weather, the keeper's daily routine and the mystery.")
    ids = tok.encode(text)
    return (ids * (args.input_len // len(ids) + 1))[: args.input_len]


def cmd_throughput(args: argparse.Namespace) -> int:
    from ridge.hub import resolve

    print(f"[bench] measuring the matmul throughput of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(device=args.device)
    llm = _ridge(args)
    if args.workload == "sharegpt":
        requests = workloads.sharegpt(llm.tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len)
    else:
        requests = workloads.random_requests(llm.engine.loaded.config.vocab_size, args.num_prompts,
                                             args.input_len, args.output_len, args.seed)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    ridge_result = ridge_throughput(args, requests, llm)
    gguf = None if is_random(args.model) else resolve(args.model)
    dtype = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    cfg = llm.engine.loaded.config
    spec = llm.engine.loaded.spec
    flops = sum(arithmetic.generation_flops(spec, len(r.prompt_ids), r.max_tokens) for r in requests)
    del llm
    _free_device_memory(args.device)
    results = [ridge_result]
    if not args.no_peers:
        reqs = [{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in requests]
        results += _run_peers(args, "throughput", reqs, gguf, dtype, spec)
    for r in results:
        if not r.error:
            t = r.figures["elapsed_s"]
            r.figures.update(requests_per_s=len(requests) / t, output_tok_s=output_tokens / t,
                             total_tok_s=(prompt_tokens + output_tokens) / t)
    ridge_fig = ridge_result.figures
    peak = roof.matmul_gflop_s.get(dtype, max(roof.matmul_gflop_s.values()))
    ridge_fig["gflop_s"] = flops / ridge_fig["elapsed_s"] / 1e9
    ridge_fig["roofline_fraction"] = ridge_fig["gflop_s"] / peak
    report = {"benchmark": "throughput", "model": args.model, "device": _device_name(args.device),
              "architecture": cfg.architecture,
              "workload": args.workload, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "machine": asdict(roof), "results": [asdict(r) for r in results]}
    if args.plot:
        _plot(results, "output_tok_s", f"{args.model}: {len(requests)} {args.workload} requests", args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\nthroughput: {args.model}, {args.workload}, {len(requests)} requests, {prompt_tokens} prompt + "
          f"{output_tokens} output tokens (EOS ignored); machine: {roof.describe()}")
    _print_table(results, [("req/s", "requests_per_s", 7, ".2f"), ("output tok/s", "output_tok_s", 13, ".1f"),
                           ("total tok/s", "total_tok_s", 12, ".1f")], ratio_key="output_tok_s")
    frac = 100 * ridge_fig["roofline_fraction"]
    print(f"ridge ran {ridge_fig['gflop_s']:.0f} GFLOP/s of weight matmuls = {frac:.0f}% "
          f"of the measured {dtype} matmul peak ({peak:.0f} GFLOP/s)")
    return 0


def _print_table(results: list[EngineResult], columns: list[tuple[str, str, int, str]], ratio_key: str) -> None:
    """One row per engine: columns are (header, figure key, width, format); ridge's figure over each peer's."""
    ridge = results[0].figures[ratio_key]
    print(f"{'engine':10s} " + " ".join(f"{h:>{w}s}" for h, _, w, _ in columns) + f" {'ridge/peer':>11s}  note")
    for r in results:
        if r.error:
            print(f"{r.engine:10s} " + " ".join(f"{'-':>{w}s}" for _, _, w, _ in columns) + f" {'-':>11s}  {r.error}")
            continue
        cells = " ".join(f"{r.figures[k]:{w}{fmt}}" for _, k, w, fmt in columns)
        print(f"{r.engine:10s} {cells} {ridge / r.figures[ratio_key]:10.2f}x  {r.note}")


def _plot(results: list[EngineResult], key: str, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if not r.error]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.engine for r in ok], [r.figures[key] for r in ok], color=["#c44" if r.engine == "ridge" else "#888"
                                                                      for r in ok])
    ax.set_ylabel(key.replace("_tok_s", " tok/s").replace("_", " "))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)  # stdout may be the --json report


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks: ridge and its peers side by side, with roofline fractions")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        add_engine_args(p)
        p.add_argument("--peer", action="append", metavar="NAME=PYTHON",
                       help=f"a peer engine's interpreter, NAME one of {', '.join(PEERS)} (repeatable)")
        p.add_argument("--all-peers", action="store_true",
                       help="every peer installed under $PEERS_DIR (default ~/.cache/ridge-peers)")
        p.add_argument("--no-peers", action="store_true", help="ridge alone")
        p.add_argument("--skip-peer", action="append", metavar="NAME", help="leave this peer out (repeatable)")
        p.add_argument("--peer-timeout", type=float, default=3600, help="seconds per peer run")
        p.add_argument("--hf-batch-size", type=int, default=16, help="HF transformers' static batch size")
        p.add_argument("--repeats", type=int, default=3, help="repeats for medians (latency)")
        p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = bsub.add_parser("latency", help="batch 1: prefill and decode tok/s, weight GB/s vs measured bandwidth; "
                                        "with --speculate/--draft-model: speculative vs plain decoding")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    g = p.add_argument_group("with --speculate / --draft-model")
    g.add_argument("--spec-workload", choices=["humaneval", "code-edit"], default="humaneval",
                   help="humaneval: complete a function; code-edit: rewrite given code (the output echoes the input)")
    g.add_argument("--num-prompts", type=int, default=4,
                   help="requests per batch size, at least the batch (default %(default)s)")
    g.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="comma-separated, e.g. 1,4,16,64 (default 1)")
    g.add_argument("--plot", default=None, metavar="PNG", help="speedup over plain by batch size")
    common(p)
    p.set_defaults(func=cmd_latency)

    p = bsub.add_parser("throughput", help="offline batch: requests/s, output and total tok/s")
    p.add_argument("--workload", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: truncate prompts to this")
    p.add_argument("--max-output-len", type=int, default=1024, help="sharegpt: cap reply lengths at this")
    p.add_argument("--input-len", type=int, default=128, help="random workload")
    p.add_argument("--output-len", type=int, default=128, help="random workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG", help="bar chart of output tok/s")
    common(p)
    p.set_defaults(func=cmd_throughput)

    add_serve_parser(bsub)
    add_soak_parser(bsub)
    add_quant_parser(bsub)
    add_invariance_parser(bsub, add_engine_args)
    add_capacity_parser(bsub, add_engine_args)
    add_kv_parser(bsub, add_engine_args)
    add_lora_parser(bsub, add_engine_args)
    add_priority_parser(bsub, add_engine_args)
    add_embed_parser(bsub, add_engine_args)
    add_vision_parser(bsub, add_engine_args)
    add_eviction_parser(bsub, add_engine_args)
    add_tp_parser(bsub, add_engine_args)
    add_router_parser(bsub)
    add_context_parser(bsub, common)
    add_structured_parser(bsub, add_engine_args)
    add_report_parser(bsub)

