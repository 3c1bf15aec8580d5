"""`ridge bench quant`: the weight formats side by side in one run, batch-1 decode and batch-B throughput,
each with the weight bytes a decode step reads and the fraction of the machine's read bandwidth that
achieves; llama.cpp on the same GGUF file beside them when it is installed.

Decode reads every weight once per step, so at batch 1 tok/s x bytes per step is the bandwidth a format
draws: a format that reads fewer bytes at the same fraction of the bandwidth is faster by its size ratio.
At batch B the same bytes serve B tokens, and what the kernels spend dequantizing starts to show.

On a shared machine a format measured minutes after another may meet a different neighbour: --rounds R
measures every format R times, in turn, and reports each figure's median over the rounds and each ratio as
the median of the rounds' ratios (formats measured next to each other in time).

The quantized formats compute in --dtype, by default the engine's own choice: bfloat16 where the CPU has
bf16 arithmetic, float32 where it would emulate it (an AVX2 CPU runs bf16 matmuls many times slower than
float32 ones, which would hide what the weight format saves).

A `random:NAME` model measures the formats on a shape that has no file to download; gguf, which runs a file's
blocks, then shows its refusal in its row, and --peer llamacpp is refused.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field

from ridge.bench import workloads
from ridge.plan import roofline

# format -> the LLM arguments it sets; a quantized format computes in --dtype
FORMATS: dict[str, dict] = {
    "float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
    **{q: {"quantization": q} for q in ("gguf", "int8", "int4", "gptq", "awq", "fp8")},
}
# NAME+MODIFIER...: "a8", int8 activations (EngineConfig.int8_activations), llama.cpp's arithmetic on CPUs, for
# the quantized formats but fp8; "eager", every step through the Python model (EngineConfig.enforce_eager)
MODIFIERS: dict[str, dict] = {"a8": {"int8_activations": True}, "eager": {"enforce_eager": True}}


def format_args(name: str) -> dict | None:
    """A format's LLM arguments, or None for a name that is not one."""
    base, *modifiers = name.split("+")
    if base not in FORMATS or any(m not in MODIFIERS for m in modifiers) or len(set(modifiers)) < len(modifiers):
        return None
    if "a8" in modifiers and base not in ("gguf", "int8", "int4", "gptq", "awq"):  # no integer kernel for the rest
        return None
    return {**FORMATS[base], **{k: v for m in modifiers for k, v in MODIFIERS[m].items()}}


@dataclass
class FormatResult:
    name: str
    weights: str = ""  # the loader's description
    weight_bytes: int = 0  # read per decode step
    decode_tok_s: float = 0.0  # batch 1
    batch_tok_s: float = 0.0  # output tok/s at batch B
    figures: dict = field(default_factory=dict)
    error: str | None = None
    rounds: list[tuple[float, float]] = field(default_factory=list)  # (decode_tok_s, batch_tok_s) per round


def _over_rounds(measured: list[FormatResult]) -> FormatResult:
    """One format's rounds as one result: the medians, each round's figures kept."""
    ok = [r for r in measured if not r.error]
    if not ok:
        return measured[0]
    result = ok[0]
    result.rounds = [(r.decode_tok_s, r.batch_tok_s) for r in ok]
    result.decode_tok_s = statistics.median(d for d, _ in result.rounds)
    result.batch_tok_s = statistics.median(b for _, b in result.rounds)
    return result


def _ratio(result: FormatResult, base: FormatResult, which: int) -> float:
    """The median over the rounds of result's figure over base's in the same round (which: 0 decode, 1 batch)."""
    return statistics.median(r[which] / b[which] for r, b in zip(result.rounds, base.rounds, strict=True))


def _measure(args: argparse.Namespace, name: str, ids: list[int]) -> FormatResult:
    from ridge import LLM
    from ridge.bench.cli import ridge_latency, ridge_throughput
    from ridge.linear import model_weight_bytes

    try:
        llm = LLM(args.model, **{"dtype": args.dtype, **format_args(name)}, quantization_group_size=args.group_size,
                  num_threads=args.threads, kv_cache_memory=args.kv_cache_memory)
    except ValueError as exc:  # e.g. gguf on a model directory
        return FormatResult(name, error=str(exc))
    computes_in = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    result = FormatResult(name, f"{llm.engine.loaded.weight_format}, computes in {computes_in}",
                          model_weight_bytes(llm.engine.loaded.model))
    result.figures = ridge_latency(args, llm, ids).figures
    result.decode_tok_s = result.figures["decode_tok_s"]
    requests = workloads.random_requests(llm.engine.loaded.config.vocab_size, args.batch, args.input_len,
                                         args.output_len, seed=0)
    elapsed = ridge_throughput(args, requests, llm).figures["elapsed_s"]  # checks the KV blocks afterwards
    result.batch_tok_s = sum(r.max_tokens for r in requests) / elapsed
    del llm
    gc.collect()
    return result


def cmd_quant(args: argparse.Namespace) -> int:
    from ridge.bench.cli import _latency_prompt, find_peers, run_peer
    from ridge.engine.loading import ModelFile

    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(args, name)}")
    unknown = [f for f in [*args.formats, args.baseline] if format_args(f) is None]
    if unknown:
        raise ValueError(f"formats: {', '.join(unknown)} not among {', '.join(FORMATS)}, each optionally "
                         f"+a8 (quantized, not fp8) and +eager")
    model = ModelFile.open(args.model)  # a random model: its shape's tokenizer, and no file for gguf or llama.cpp
    found = find_peers(args.peer or [], all_installed=False)
    if "llamacpp" in found and model.gguf is None:
        raise ValueError(f"--peer: llama.cpp runs a GGUF file, and {args.model} is not one")
    print("[bench] measuring this machine's read bandwidth ...", file=sys.stderr)
    roof = roofline.measure(dtypes=())
    ids = _latency_prompt(args, model.tokenizer)
    measured: dict[str, list[FormatResult]] = {name: [] for name in args.formats}
    for k in range(args.rounds):
        for name in args.formats:
            print(f"[bench] {name} (round {k + 1} of {args.rounds}) ...", file=sys.stderr, flush=True)
            measured[name].append(_measure(args, name, ids))
    results = [_over_rounds(measured[name]) for name in args.formats]
    peer = None
    if "llamacpp" in found:
        print("[bench] llama.cpp ...", file=sys.stderr, flush=True)
        job = {"mode": "latency", "gguf": str(model.path), "dtype": "bfloat16", "repeats": args.repeats,
               "requests": [{"prompt_ids": ids, "max_tokens": args.output_len}], "threads": args.threads}
        peer = run_peer("llamacpp", found["llamacpp"], job, timeout=1800)
    roof = roofline.remeasured(roof)
    base = next((r for r in results if r.name == args.baseline and not r.error), None)
    theirs = peer.figures["decode_tok_s"] if peer is not None and not peer.error else None
    rows = [_row(r, base, theirs, roof.read_gb_s) for r in results]
    report = {"benchmark": "quant", "model": args.model, "prompt_tokens": len(ids), "new_tokens": args.output_len,
              "batch": args.batch, "baseline": args.baseline, "machine": {"read_gb_s": roof.read_gb_s}, "formats": rows,
              "llamacpp": None if peer is None else asdict(peer)}
    if args.plot:
        _plot([r for r in results if not r.error], args.plot, args.model, theirs)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_table(args, rows, len(ids), roof.read_gb_s)
    if peer is not None:
        if peer.error:
            print(f"llama.cpp: {peer.error}")
        else:
            ratios = ", ".join(f"ridge {row['name']} / llama.cpp = {row['decode_vs_llamacpp']:.2f}x"
                               for row in rows if "decode_vs_llamacpp" in row)
            print(f"llama.cpp on the same file: decode {theirs:.1f} tok/s" + (f" ({ratios})" if ratios else ""))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _row(r: FormatResult, base: FormatResult | None, llamacpp_tok_s: float | None, read_gb_s: float) -> dict:
    """One format's figures, with its bandwidth, its fraction of the machine's and its ratios."""
    row = {**asdict(r), "figures": r.figures}
    if not r.error:
        row["weight_gb_s"] = r.weight_bytes * r.decode_tok_s / 1e9
        row["read_fraction"] = row["weight_gb_s"] / read_gb_s
        if base:
            row["decode_vs_baseline"] = _ratio(r, base, 0)
            row["batch_vs_baseline"] = _ratio(r, base, 1)
        if llamacpp_tok_s and r.name.startswith("gguf"):  # the same file's blocks as llama.cpp runs them
            row["decode_vs_llamacpp"] = r.decode_tok_s / llamacpp_tok_s
    return row


def _print_table(args: argparse.Namespace, rows: list[dict], prompt_tokens: int, read_gb_s: float) -> None:
    rounds = f"; medians of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"\nweight formats: {args.model}, {prompt_tokens}-token prompt, {args.output_len} new tokens; batch 1 "
          f"(median of {args.repeats}) and batch {args.batch}{rounds}; read bandwidth {read_gb_s:.1f} GB/s")
    versus = f"vs {args.baseline}"
    width = max(9, *(len(row["name"]) for row in rows))
    print(f"{'format':{width}s} {'MB/step':>8s} {'decode tok/s':>13s} {versus:>11s} {'GB/s':>6s} {'of bw':>6s} "
          f"{'batch tok/s':>12s} {versus:>11s}  weights")

    def ratio(row: dict, key: str) -> str:  # "-" without a baseline row to compare with
        return f"{row[key]:10.2f}x" if key in row else f"{'-':>11s}"

    for row in rows:
        if row["error"]:
            print(f"{row['name']:{width}s} {'-':>8s}  {row['error']}")
            continue
        print(f"{row['name']:{width}s} {row['weight_bytes'] / 1e6:8.0f} {row['decode_tok_s']:13.1f} "
              f"{ratio(row, 'decode_vs_baseline')} {row['weight_gb_s']:6.1f} {100 * row['read_fraction']:5.0f}% "
              f"{row['batch_tok_s']:12.1f} {ratio(row, 'batch_vs_baseline')}  {row['weights']}")


def _plot(results: list[FormatResult], path: str, model: str, llamacpp_tok_s: float | None) -> None:
    """Batch-1 decode tok/s per format, one bar each, with the MB a step reads (llama.cpp's are not measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(r.name, r.decode_tok_s, f"{r.weight_bytes / 1e6:.0f} MB/step") for r in results]
    if llamacpp_tok_s:
        bars.append(("llama.cpp (same file)", llamacpp_tok_s, ""))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(bars) + 1.2))
    names, speeds, notes = zip(*reversed(bars), strict=True)  # the first format on top
    colors = ["grey" if n.startswith("llama.cpp") else "tab:blue" for n in names]
    ax.barh(names, speeds, color=colors)
    for y, (speed, note) in enumerate(zip(speeds, notes, strict=True)):
        ax.annotate(f"{speed:.1f}  {note}", (speed, y), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.set_xlim(0, 1.3 * max(speeds))
    ax.set_xlabel("batch-1 decode tok/s")
    ax.set_title(f"{model}: weight formats, batch-1 decode")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_quant_parser(bsub) -> None:
    p = bsub.add_parser("quant", help="weight formats side by side: batch-1 decode, batch-B throughput, GB/s",
                        description="Load the model once per weight format and measure batch-1 decode tok/s and "
                                    "output tok/s at --batch, with the weight bytes a step reads and the fraction "
                                    "of the measured read bandwidth; llama.cpp on the same GGUF file with "
                                    "--peer llamacpp=PYTHON.")
    p.add_argument("model", nargs="?", default="smollm2", help="alias, .gguf file or HF directory")
    p.add_argument("--formats", type=lambda s: s.split(","), default=["float32", "bfloat16", "gguf", "int8", "int4"],
                   help=f"comma-separated, of {', '.join(FORMATS)}; NAME+a8: with --int8-activations (quantized, not "
                        "fp8), NAME+eager: with --enforce-eager (default float32,bfloat16,gguf,int8,int4)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="what the quantized formats compute in; auto: bfloat16 where the CPU has bf16 "
                        "arithmetic (AVX512-BF16, AMX), else float32, as the engine chooses (default auto)")
    p.add_argument("--baseline", default="bfloat16",
                   help="the format the others' speed is divided by, one of --formats (default %(default)s)")
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 / gptq / awq: input columns per scale and minimum (default %(default)s)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="requests decoded together (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 repeats for the median")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every format this many times, in turn; figures and ratios are medians over the "
                        "rounds (default %(default)s)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--peer", action="append", metavar="llamacpp=PYTHON", help="llama.cpp's interpreter")
    p.add_argument("--plot", default=None, metavar="PNG", help="batch-1 decode tok/s, a bar per format")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_quant)
