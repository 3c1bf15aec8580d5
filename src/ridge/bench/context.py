"""`ridge bench context`: batch-1 decode time per token as the context grows, for models side by side.

The question it answers: what does a longer context cost a decode step? An attention layer reads its whole KV
cache every step, so its time per token grows with the context; a state-space layer (Mamba-2) reads and writes a
state of fixed size, so its time stays flat. Each model runs in ridge and in HF transformers (the same random
shape, or the same GGUF) at each context, in one run; ratios, the bytes a step must move (weights, KV and state:
the plan's arithmetic) as a fraction of the measured read bandwidth, and a plot of time per token by context.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict

from tqdm import tqdm

from ridge.plan import arithmetic, roofline

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def cmd_context(args: argparse.Namespace) -> int:
    from ridge.bench.cli import _device_name, _free_device_memory, _ridge, _run_peers
    from ridge.hub import resolve
    from ridge.linear import model_weight_bytes
    from ridge.models.random_weights import is_random

    if args.model is not None:
        raise ValueError("model: bench context takes its models from --models (';'-separated)")
    print(f"[bench] measuring the read bandwidth of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(dtypes=(), device=args.device)
    args.enable_prefix_caching = False  # every run repeats its prompt: each must prefill it whole
    args.max_model_len = max(args.max_model_len or 0, max(args.contexts) + args.output_len)
    rows = []
    for model in args.models:
        args.model = model
        llm = _ridge(args)
        spec, dtype = llm.engine.loaded.spec, str(llm.engine.config.torch_dtype).removeprefix("torch.")
        weights = model_weight_bytes(llm.engine.loaded.model)
        prompts = {ctx: [random.Random(ctx).randrange(10, spec.vocab_size - 10) for _ in range(ctx)]
                   for ctx in args.contexts}
        ridge_runs = {ctx: _ridge_run(args, llm, prompts[ctx])
                      for ctx in tqdm(args.contexts, desc=f"ridge {_short(model)}", unit="context", leave=False)}
        del llm
        _free_device_memory(args.device)
        gguf = None if is_random(model) else resolve(model)
        for ctx in args.contexts:
            peers = [] if args.no_peers or ridge_runs[ctx].error else _run_peers(
                args, "latency", [{"prompt_ids": prompts[ctx], "max_tokens": args.output_len}], gguf, dtype, spec)
            step_bytes = (weights + arithmetic.kv_read_bytes(spec, DTYPE_NAMES.get(dtype, dtype), ctx)
                          + 2 * arithmetic.state_bytes(spec))
            for result in [ridge_runs[ctx], *peers]:
                row = {"model": model, "context": ctx, "engine": result.engine, "error": result.error,
                       "note": result.note, "step_bytes": step_bytes}
                if not result.error:
                    tok_s = result.figures["decode_tok_s"]
                    row.update(ms_per_token=1e3 / tok_s, decode_tok_s=tok_s)
                rows.append(row)
        roof = roofline.remeasured(roof, args.device)
    for row in rows:
        if "decode_tok_s" in row:
            row["read_fraction"] = row["step_bytes"] * row["decode_tok_s"] / 1e9 / roof.read_gb_s
    report = {"benchmark": "context", "device": _device_name(args.device), "new_tokens": args.output_len,
              "machine": asdict(roof), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"\nbatch-1 decode by context: {args.output_len} new tokens after each prompt, median of "
              f"{args.repeats}; {report['device']}, read bandwidth {roof.read_gb_s:.1f} GB/s")
        for line in context_table(report):
            print(line)
    if args.plot:
        plot_context(rows, args.plot)
    return 0


def _ridge_run(args: argparse.Namespace, llm, ids: list[int]):
    """ridge's latency at one context, or the reason it cannot run it (a context past the model's limit)."""
    from ridge.bench.cli import EngineResult, ridge_latency

    try:
        return ridge_latency(args, llm, ids)
    except ValueError as exc:
        return EngineResult("ridge", error=str(exc))


def context_table(report: dict) -> list[str]:
    """One row per model and context: ridge's and each peer's ms per token, ridge's bytes a step moves and their
    share of the measured bandwidth, and each context's time against the shortest one's."""
    rows = report["rows"]
    peers = sorted({r["engine"] for r in rows if not r["error"]} - {"ridge"})  # those that ran
    header = ["model", "context", "ridge ms/token", "vs shortest context",
              *(cell for p in peers for cell in (f"{p} ms/token", f"ridge vs {p}")), "MB a step moves",
              "of read bandwidth"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for model in dict.fromkeys(r["model"] for r in rows):
        ours = [r for r in rows if r["model"] == model and r["engine"] == "ridge"]
        first = ours[0].get("ms_per_token")
        for r in ours:
            if r["error"]:
                lines.append(f"| {_short(model)} | {r['context']:,} | {r['error']} |")
                continue
            cells = [f"{r['ms_per_token']:.1f}", f"{r['ms_per_token'] / first:.2f}x"]
            for p in peers:
                peer = next((x for x in rows if x["model"] == model and x["context"] == r["context"]
                             and x["engine"] == p), None)
                if peer is None or peer["error"]:
                    cells += ["-", "-"]
                else:
                    cells += [f"{peer['ms_per_token']:.1f}", f"{peer['ms_per_token'] / r['ms_per_token']:.2f}x"]
            cells += [f"{r['step_bytes'] / 1e6:,.0f}", f"{100 * r['read_fraction']:.0f}%"]
            lines.append(f"| {_short(model)} | {r['context']:,} | " + " | ".join(cells) + " |")
    failed = {(r["engine"], r["error"]) for r in rows if r["error"] and r["engine"] not in peers}
    if failed:
        lines += ["", *(f"{engine}: {error}" for engine, error in sorted(failed))]
    return lines


def plot_context(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        for engine in dict.fromkeys(r["engine"] for r in rows):
            points = [r for r in rows if r["model"] == model and r["engine"] == engine and not r["error"]]
            if points:
                ax.plot([r["context"] for r in points], [r["ms_per_token"] for r in points], marker="o",
                        linestyle="-" if engine == "ridge" else "--", label=f"{engine}: {_short(model)}")
    contexts = sorted({r["context"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms per token (batch 1)")
    ax.set_ylim(bottom=0)
    ax.set_title("time per token as the context grows")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)  # stdout may be the --json report


def _short(model: str) -> str:
    """A legend's name for a model: a random shape's preset with its layer count, width and sparse attention's top k
    where changed, or the file's name."""
    name, *changes = model.removeprefix("random:").split(",")
    fields = dict(c.partition("=")[::2] for c in changes)
    label = name.rsplit("/", 1)[-1]
    if "num_layers" in fields:
        label += f", {fields.pop('num_layers')} layers"
    if "hidden_size" in fields:
        label += f", {fields.pop('hidden_size')} wide"
    if "index_topk" in fields:  # sparse attention's choice: what tells two such models apart
        label += f", top {fields.pop('index_topk')} keys"
    return label + (f" (+{len(fields)} changes)" if fields else "")


def add_context_parser(bsub, common) -> None:
    p = bsub.add_parser("context", help="batch-1 decode ms per token as the context grows: state-space vs "
                                        "attention models, each beside HF transformers, with a plot")
    p.add_argument("--models", type=lambda s: s.split(";"), required=True,
                   help="models separated by ';' (random:PRESET[,field=value...] shapes, or files), e.g. "
                        "'random:mamba2-2.7b,num_layers=8;random:llama-3-8b,num_layers=4'")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192],
                   help="prompt lengths (default 1024,2048,4096,8192)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens timed after each prompt")
    p.add_argument("--plot", default=None, metavar="PNG", help="ms per token by context, a line per model and engine")
    common(p)
    p.set_defaults(func=cmd_context, model=None)
