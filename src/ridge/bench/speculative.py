"""`ridge bench latency --speculate ngram | --draft-model M`: speculative decoding beside plain decoding.

One engine, its drafter loaded once; each batch size runs the same greedy requests three ways (plain,
fixed k, adaptive) by switching the engine's speculation policy, so the runs differ in nothing else.
Greedy outputs are identical across the three (checked), so the speedup is pure decode time.

Beside each measured speedup the table prints the break-even model's prediction from what the run
measured: the per-token acceptance rate a (from the mean accepted length), and the drafter's cost per
pass relative to a plain target step, c. Predicted speedup = E(a, k) / (1 + c k), E = (1 - a^(k+1)) / (1 - a).
The model takes a verification pass (k + 1 tokens per sequence) to cost what a plain step costs; the
measured/predicted gap is mostly that assumption failing as the batch grows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from ridge.bench import workloads
from ridge.engine.speculative import SpeculationStats, expected_tokens

MODES = ("plain", "fixed", "adaptive")


@dataclass
class SpecRun:
    batch: int
    mode: str
    decode_tok_s: float
    output_tokens: int
    step_s: float  # seconds per target step (plain) or per drafting pass (speculative runs)
    acceptance: float | None = None  # per-token acceptance rate a, fitted to the mean accepted length
    mean_accepted_length: float | None = None  # tokens per verification, the target's own included
    speedup: float | None = None
    predicted: float | None = None
    draft_cost: float | None = None  # c
    spread: float | None = None  # standard deviation of decode tok/s over the rounds, relative


def acceptance_from_length(mean_length: float, k: int) -> float:
    """Invert E(a, k) = mean tokens per verification for a, by bisection (E grows with a)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mean_length else (lo, mid)
    return (lo + hi) / 2


def _requests(args: argparse.Namespace, tokenizer) -> list[workloads.Request]:
    make = {"humaneval": workloads.humaneval, "code-edit": workloads.code_edit}[args.spec_workload]
    return make(tokenizer, max(args.num_prompts, max(args.batch_sizes)), args.output_len)


def _run(llm, requests: list[workloads.Request], batch: int, mode: str) -> tuple[list, float]:
    """All requests, `batch` at a time; the outputs and the decode seconds (each group's time after its
    last first token)."""
    from ridge import SamplingParams

    llm.engine.set_speculation(None if mode == "plain" else mode)
    params = SamplingParams(temperature=0, max_tokens=requests[0].max_tokens)
    outputs, decode_s = [], 0.0
    for first in range(0, len(requests), batch):
        start = time.perf_counter()
        group = llm.generate([r.prompt_ids for r in requests[first:first + batch]], params)
        decode_s += time.perf_counter() - start - max(o.metrics["ttft_s"] for o in group)
        outputs += group
    llm.engine.check_integrity()
    return outputs, decode_s


def measure(llm, requests: list[workloads.Request], batch_sizes: list[int], k: int, num_prompts: int,
            repeats: int = 1) -> list[SpecRun]:
    """Each batch size runs max(batch, num_prompts) requests, `batch` at a time, in `repeats` rounds of
    plain, fixed, adaptive (interleaved, so that a drift of the machine touches every mode alike); each
    mode keeps its median round by decode speed."""
    import statistics

    from tqdm import tqdm

    runs: list[SpecRun] = []
    _run(llm, requests[:1], 1, "fixed")  # warm-up: kernels, both models
    with tqdm(total=len(batch_sizes) * len(MODES) * repeats, desc="bench speculative", unit="run",
              file=sys.stderr) as bar:
        for batch in batch_sizes:
            chosen = (requests * batch)[:max(batch, num_prompts)]
            rounds: dict[str, list[SpecRun]] = {mode: [] for mode in MODES}
            plain_tokens = None
            for _ in range(repeats):
                for mode in MODES:
                    run, tokens = _measure_once(llm, chosen, batch, mode, k)
                    if plain_tokens is None:
                        plain_tokens = tokens
                    elif tokens != plain_tokens:
                        raise AssertionError(f"batch {batch}, {mode}: greedy output differs from plain decoding")
                    rounds[mode].append(run)
                    bar.update(1)
            chosen_runs = {mode: sorted(rs, key=lambda r: r.decode_tok_s)[(len(rs) - 1) // 2]
                           for mode, rs in rounds.items()}
            plain = chosen_runs["plain"]
            for mode, run in chosen_runs.items():
                run.speedup = run.decode_tok_s / plain.decode_tok_s
                run.spread = (statistics.pstdev(r.decode_tok_s for r in rounds[mode]) / run.decode_tok_s
                              if repeats > 1 else None)
                if mode == "fixed" and run.mean_accepted_length is not None:
                    run.acceptance = acceptance_from_length(run.mean_accepted_length, k)
                    run.draft_cost = run.step_s / plain.step_s
                    run.predicted = expected_tokens(run.acceptance, k) / (1 + run.draft_cost * k)
                runs.append(run)
    return runs


def _measure_once(llm, chosen: list[workloads.Request], batch: int, mode: str, k: int) -> tuple[SpecRun, list]:
    outputs, decode_s = _run(llm, chosen, batch, mode)
    tokens = [o.outputs[0].token_ids for o in outputs]
    decoded = sum(len(t) - 1 for t in tokens)
    groups = [tokens[i:i + batch] for i in range(0, len(tokens), batch)]
    steps = sum(max(len(t) for t in g) - 1 for g in groups)
    run = SpecRun(batch, mode, decoded / decode_s, sum(len(t) for t in tokens), decode_s / max(steps, 1))
    drafts = sum(o.metrics.get("spec_drafts", 0) for o in outputs)
    if mode != "plain" and drafts:
        run.mean_accepted_length = SpeculationStats(
            drafts, num_accepted_tokens=sum(o.metrics["spec_accepted_tokens"] for o in outputs)).mean_accepted_length
        run.step_s = llm.engine.speculation.draft_cost.mean()  # this run's: set_speculation starts afresh
    return run, tokens


def report(args: argparse.Namespace, llm, runs: list[SpecRun], num_prompts: int) -> None:
    drafter = f"draft model {args.draft_model}" if args.draft_model else "n-gram prompt lookup"
    k = args.num_speculative_tokens
    if args.plot:
        _plot(runs, args.plot, f"{args.model}: {drafter}, k={k}")
    if args.json:
        print(json.dumps({"benchmark": "speculative", "model": args.model, "drafter": drafter, "k": k,
                          "workload": args.spec_workload, "prompts": num_prompts, "output_len": args.output_len,
                          "runs": [asdict(r) for r in runs]}, indent=2))
        return
    print(f"\nspeculative decoding: {args.model}, {drafter}, k={k}, {args.spec_workload} prompts, "
          f"up to {args.output_len} new tokens, greedy (outputs checked identical to plain), "
          f"median of {args.repeats} interleaved rounds")
    print(f"{'batch':>5s} {'mode':9s} {'decode tok/s':>12s} {'spread':>7s} {'speedup':>8s} {'accept a':>9s} "
          f"{'tokens/pass':>12s} {'c':>6s} {'predicted':>10s}")
    def cell(value: float | None, width: int, spec: str, unit: str = "") -> str:
        return f"{'-':>{width}s}" if value is None else f"{format(value, spec) + unit:>{width}s}"

    for r in runs:
        print(f"{r.batch:5d} {r.mode:9s} {r.decode_tok_s:12.2f} {cell(r.spread and 100 * r.spread, 7, '.1f', '%')} "
              f"{cell(r.speedup, 8, '.2f', 'x')} "
              f"{cell(r.acceptance, 9, '.2f')} {cell(r.mean_accepted_length, 12, '.2f')} "
              f"{cell(r.draft_cost, 6, '.3f')} {cell(r.predicted, 10, '.2f', 'x')}")
    print("predicted = E(a, k) / (1 + c k): a from the measured tokens per verification, c = one drafting pass "
          "over one plain target step, both measured in this run; it assumes verifying k + 1 tokens costs one "
          "plain step, which holds while the target's step is bound by its weight reads (small batches).")


def _plot(runs: list[SpecRun], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, style in (("fixed", "o-"), ("adaptive", "s-")):
        points = [(r.batch, r.speedup) for r in runs if r.mode == mode]
        ax.plot([b for b, _ in points], [s for _, s in points], style, label=mode)
    ax.axhline(1.0, color="#888", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode speedup over plain")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)  # stdout may be the --json report


def cmd_speculative(args: argparse.Namespace, llm) -> int:
    requests = _requests(args, llm.tokenizer)
    runs = measure(llm, requests, args.batch_sizes, args.num_speculative_tokens, args.num_prompts, args.repeats)
    report(args, llm, runs, args.num_prompts)
    return 0
