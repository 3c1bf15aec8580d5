"""`ridge bench invariance`: does a greedy output under load equal the same prompt's output alone?

Each mode (ridge as configured, then with --batch-invariant) loads the model once, runs the prompts all at
once (continuous batching, chunked prefill, preemption when the pool is small), then each prompt alone, and
counts the outputs that differ and where they first part. A pool small enough to preempt separates the two
causes: if outputs differ with no preemption at all, the numbers differ (kernels whose result for a row
depends on the batch); if only under preemption, the recompute does. The batch's speed in both modes prices
the invariance: output tok/s, their ratio, and the fraction of the machine's measured matmul peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from ridge.plan import arithmetic


@dataclass
class ModeResult:
    mode: str
    preemptions: int = 0
    differ: int = 0
    first_differing_token: list[int] = field(default_factory=list)
    batch_s: float = 0.0
    output_tok_s: float = 0.0
    alone_tok_s: float = 0.0  # the prompts one after another: batch-1 decode plus each prefill
    gflop_s: float = 0.0
    roofline_fraction: float = 0.0


def run_mode(args: argparse.Namespace, batch_invariant: bool, peak_gflop_s: float) -> ModeResult:
    from ridge import LLM, SamplingParams
    from ridge.bench import workloads
    from ridge.flags import engine_kwargs

    mode = "batch invariant" if batch_invariant else "default"
    llm = LLM(args.model, **{**engine_kwargs(args), "batch_invariant": batch_invariant})
    tokenizer = llm.tokenizer
    # room for every output in the context: a reply cut by max_model_len is no divergence
    max_prompt = min(args.max_prompt_len, llm.engine.max_model_len - args.output_len)
    if max_prompt < 40:
        raise ValueError(f"--output-len: {args.output_len} leaves no room for a prompt in the context of "
                         f"{llm.engine.max_model_len} tokens (--kv-cache-memory sets it)")
    requests = workloads.sharegpt(tokenizer, args.num_prompts, max_prompt - 32, args.output_len)  # 32: the template
    prompts = [tokenizer.encode_chat([{"role": "user", "content": tokenizer.decode(r.prompt_ids)}])[:max_prompt]
               for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    started = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=True)
    result = ModeResult(mode, batch_s=time.perf_counter() - started)
    result.preemptions = sum(o.metrics.get("num_preemptions") or 0 for o in batch)
    alone_s = 0.0
    for prompt, under_load in tqdm(list(zip(prompts, batch, strict=True)), desc=f"{mode}: each prompt alone",
                                   unit="req"):
        started = time.perf_counter()
        alone = llm.generate([prompt], params)[0].outputs[0].token_ids
        alone_s += time.perf_counter() - started
        loaded = under_load.outputs[0].token_ids
        if alone != loaded:
            result.differ += 1
            pairs = enumerate(zip(alone, loaded, strict=True))
            result.first_differing_token.append(next(i for i, (a, b) in pairs if a != b))
    tokens = len(prompts) * args.output_len
    result.output_tok_s = tokens / result.batch_s
    result.alone_tok_s = tokens / alone_s
    spec = llm.engine.loaded.spec
    flops = sum(arithmetic.generation_flops(spec, len(prompt), args.output_len) for prompt in prompts)
    result.gflop_s = flops / result.batch_s / 1e9
    result.roofline_fraction = result.gflop_s / peak_gflop_s
    return result


def cmd_invariance(args: argparse.Namespace) -> int:
    from ridge.config import resolve_dtype
    from ridge.plan import roofline

    if args.batch_invariant:
        raise ValueError("--batch-invariant: `bench invariance` runs the default mode and the batch-invariant one "
                         "itself, side by side; leave the flag out")
    dtype = resolve_dtype(args.dtype, args.device)
    print(f"[bench] measuring this machine's {str(dtype).removeprefix('torch.')} matmul throughput ...",
          file=sys.stderr)
    peak = roofline.measure_matmul(dtype)
    results = [run_mode(args, invariant, peak) for invariant in (False, True)]
    report = {"benchmark": "invariance", "model": args.model, "dtype": str(dtype).removeprefix("torch."),
              "kv_cache_memory": args.kv_cache_memory, "num_prompts": args.num_prompts, "output_len": args.output_len,
              "matmul_gflop_s": peak, "results": [dataclasses.asdict(r) for r in results]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\ngreedy under load vs alone: {args.model}, {report['dtype']}, {args.num_prompts} ShareGPT chats, "
          f"{args.output_len} tokens each, pool {args.kv_cache_memory}; matmul peak {peak:.0f} GFLOP/s")
    print(f"{'mode':<17} {'preemptions':>11} {'differ':>8} {'first differing token (median)':>31} "
          f"{'output tok/s':>13} {'GFLOP/s':>8} {'of peak':>8} {'alone tok/s':>12}")
    for r in results:
        first = f"{statistics.median(r.first_differing_token):.0f}" if r.first_differing_token else "-"
        print(f"{r.mode:<17} {r.preemptions:>11} {r.differ:>4} / {args.num_prompts:<3}{first:>31} "
              f"{r.output_tok_s:>13.1f} {r.gflop_s:>8.1f} {r.roofline_fraction:>8.1%} {r.alone_tok_s:>12.1f}")
    default, invariant = results
    print(f"batch invariant / default: {invariant.output_tok_s / default.output_tok_s:.2f}x under load, "
          f"{invariant.alone_tok_s / default.alone_tok_s:.2f}x alone")
    return 0 if results[1].differ == 0 else 1


def add_invariance_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("invariance", help="greedy outputs under load vs each prompt alone, default and "
                                           "--batch-invariant, side by side",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256, help="chat prompts are cut to this many tokens")
    p.add_argument("--output-len", type=int, default=96, help="greedy tokens per prompt (EOS ignored)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_invariance)
