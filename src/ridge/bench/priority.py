"""`ridge bench priority`: how much sooner urgent requests are served under --schedule-policy priority, and what the
work they displace pays.

One workload, run twice on one engine configuration: --background requests (random prompts of --input-len tokens,
--output-len tokens each) queued at once, which fill the engine's --max-num-seqs; then, after --warmup steps, one
urgent request (--urgent-input-len / --urgent-output-len) every --every steps until --urgent of them came. Under
fcfs all are equal; under priority the background runs at priority 1 and the urgent at 0 (lower goes first), so
an urgent arrival displaces a running background request (which recomputes its tokens later). Arrivals count
engine steps, not seconds, so both runs see them at the same point of the work.

Per run: the urgent requests' time to first token and end-to-end latency (from their arrival), the background's
latency and the whole run's (its makespan), output tokens per second, the preemptions and the tokens recomputed
after them, and the weights' bytes read per second as a fraction of the machine's measured read bandwidth. The
question it answers: does priority scheduling cut the urgent requests' waits, and at what cost in throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from ridge.plan import roofline

BACKGROUND, URGENT = 1, 0  # the priorities under the priority policy (lower goes first)


@dataclass
class Tracked:
    arrival: float
    arrival_step: int
    urgent: bool
    first_token: float | None = None
    first_token_step: int | None = None
    finished: float | None = None


@dataclass
class PolicyRun:
    policy: str
    urgent_ttft_ms: list[float] = field(default_factory=list)
    urgent_ttft_steps: list[int] = field(default_factory=list)  # engine steps from arrival to the first token
    urgent_e2e_ms: list[float] = field(default_factory=list)
    background_e2e_ms: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0  # that ran a forward pass
    preemptions: int = 0
    recomputed_tokens: int = 0  # prefill tokens beyond the prompts': the displaced requests' tokens again
    weight_read_fraction: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def run_policy(engine, policy: str, args: argparse.Namespace, read_gb_s: float) -> PolicyRun:
    """The workload on `engine` (scheduling by `policy`): background at once, urgent arrivals every args.every steps."""
    from ridge.linear import model_weight_bytes
    from ridge.sampling_params import SamplingParams

    vocab = engine.loaded.config.vocab_size
    background = prompts(vocab, args.background, args.input_len, seed=1)
    urgent = prompts(vocab, args.urgent, args.urgent_input_len, seed=2)
    ranked = policy == "priority"
    tracked: dict[str, Tracked] = {}

    def add(ids: list[int], max_tokens: int, is_urgent: bool) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        priority = (URGENT if is_urgent else BACKGROUND) if ranked else 0
        request_id = engine.add_request(ids, params, priority=priority)
        tracked[request_id] = Tracked(time.perf_counter(), stepped, is_urgent)

    result = PolicyRun(policy)
    prompt_tokens = args.background * args.input_len + args.urgent * args.urgent_input_len
    prefilled = stepped = 0
    start = time.perf_counter()
    for ids in background:
        add(ids, args.output_len, False)
    total = args.background * args.output_len + args.urgent * args.urgent_output_len
    with tqdm(total=total, desc=policy, unit="tok", leave=False, disable=args.json) as bar:
        while engine.has_unfinished or len(urgent) > 0:
            if urgent and stepped >= args.warmup and (stepped - args.warmup) % args.every == 0:
                add(urgent.pop(0), args.urgent_output_len, True)
            deltas = engine.step()
            now = time.perf_counter()
            stepped += 1
            stats = engine.last_step
            result.steps += bool(stats.prefill_tokens or stats.sampled_tokens)  # a step that read the weights
            result.preemptions += stats.preemptions
            prefilled += stats.prefill_tokens
            for delta in deltas:
                request = tracked[delta.request_id]
                produced = len(delta.samples[0].token_ids)
                result.output_tokens += produced
                bar.update(produced)
                if produced and request.first_token is None:
                    request.first_token, request.first_token_step = now, stepped
                if delta.finished:
                    request.finished = now
    result.makespan_s = time.perf_counter() - start
    result.recomputed_tokens = prefilled - prompt_tokens
    for request in tracked.values():
        e2e = 1e3 * (request.finished - request.arrival)
        if request.urgent:
            result.urgent_ttft_ms.append(1e3 * (request.first_token - request.arrival))
            result.urgent_ttft_steps.append(request.first_token_step - request.arrival_step)
            result.urgent_e2e_ms.append(e2e)
        else:
            result.background_e2e_ms.append(e2e)
    weight_gb_s = result.steps * model_weight_bytes(engine.loaded.model) / result.makespan_s / 1e9
    result.weight_read_fraction = weight_gb_s / read_gb_s
    return result


def summary(run: PolicyRun) -> dict:
    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"policy": run.policy, "urgent_ttft_ms_p50": statistics.median(run.urgent_ttft_ms),
            "urgent_ttft_ms_max": max(run.urgent_ttft_ms), "urgent_ttft_steps_mean": statistics.mean(
                run.urgent_ttft_steps), "urgent_e2e_ms_p50": statistics.median(run.urgent_e2e_ms),
            "background_e2e_ms_p50": statistics.median(run.background_e2e_ms),
            "background_e2e_ms_p90": pct(run.background_e2e_ms, 0.9), "makespan_s": run.makespan_s,
            "output_tok_s": run.output_tok_s, "steps": run.steps, "preemptions": run.preemptions,
            "recomputed_tokens": run.recomputed_tokens, "weight_read_fraction": run.weight_read_fraction}


def cmd_priority(args: argparse.Namespace) -> int:
    from ridge import LLM
    from ridge.flags import engine_kwargs

    if args.urgent < 1 or args.background < 1 or args.every < 1:
        raise ValueError("--urgent, --background and --every: must be at least 1")
    if args.schedule_policy != "lpm":  # its default: the flag was given
        raise ValueError("--schedule-policy: bench priority runs fcfs and priority itself; leave the flag out")
    print(f"[bench] measuring the read bandwidth of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(dtypes=(), device=args.device)
    kwargs = engine_kwargs(args)
    kwargs["max_model_len"] = max(args.input_len + args.output_len, args.urgent_input_len + args.urgent_output_len)
    rows = []
    for policy in ("fcfs", "priority"):
        llm = LLM(args.model, progress=not args.json, **{**kwargs, "schedule_policy": policy})
        engine = llm.engine
        rows.append(summary(run_policy(engine, policy, args, roof.read_gb_s)))
        engine.check_integrity()
        del llm, engine
    fcfs, ranked = rows
    report = {"benchmark": "priority", "model": args.model, "max_num_seqs": args.max_num_seqs,
              "background": args.background, "input_len": args.input_len, "output_len": args.output_len,
              "urgent": args.urgent, "urgent_input_len": args.urgent_input_len,
              "urgent_output_len": args.urgent_output_len, "every": args.every, "warmup": args.warmup,
              "machine": dataclasses.asdict(roof), "rows": rows,
              "urgent_ttft_speedup": fcfs["urgent_ttft_ms_p50"] / ranked["urgent_ttft_ms_p50"],
              "throughput_ratio": ranked["output_tok_s"] / fcfs["output_tok_s"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: {args.background} background requests ({args.input_len} + {args.output_len} tokens) "
          f"over {args.max_num_seqs} sequences at once, {args.urgent} urgent ({args.urgent_input_len} + "
          f"{args.urgent_output_len}) arriving every {args.every} steps; read bandwidth {roof.read_gb_s:.1f} GB/s")
    for line in priority_table(report):
        print(line)
    print(f"\npriority / fcfs: urgent TTFT {report['urgent_ttft_speedup']:.1f}x shorter, output throughput "
          f"{report['throughput_ratio']:.2f}x")
    return 0


def priority_table(report: dict) -> list[str]:
    lines = ["| policy | urgent TTFT p50 (ms) | urgent TTFT max | urgent TTFT (steps, mean) | urgent E2E p50 | "
             "background E2E p50 | background E2E p90 | makespan (s) | output tok/s | preemptions | "
             "tokens recomputed | weight reads / bandwidth |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['policy']} | {r['urgent_ttft_ms_p50']:,.0f} | {r['urgent_ttft_ms_max']:,.0f} | "
                     f"{r['urgent_ttft_steps_mean']:.1f} | "
                     f"{r['urgent_e2e_ms_p50']:,.0f} | {r['background_e2e_ms_p50']:,.0f} | "
                     f"{r['background_e2e_ms_p90']:,.0f} | {r['makespan_s']:.1f} | {r['output_tok_s']:.1f} | "
                     f"{r['preemptions']} | {r['recomputed_tokens']:,} | {r['weight_read_fraction']:.0%} |")
    return lines


def add_priority_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("priority", help="urgent requests' waits under --schedule-policy priority against fcfs, "
                                         "on a saturated engine, and what the displaced work pays",
                        description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--background", type=int, default=16, help="background requests queued at the start "
                   "(default %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="a background prompt's tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="a background request's output tokens "
                   "(default %(default)s)")
    p.add_argument("--urgent", type=int, default=8, help="urgent requests (default %(default)s)")
    p.add_argument("--urgent-input-len", type=int, default=64, help="(default %(default)s)")
    p.add_argument("--urgent-output-len", type=int, default=16, help="(default %(default)s)")
    p.add_argument("--every", type=int, default=24, help="engine steps between urgent arrivals (default %(default)s)")
    p.add_argument("--warmup", type=int, default=16, help="engine steps before the first urgent arrival "
                   "(default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_priority, max_num_seqs=8)
