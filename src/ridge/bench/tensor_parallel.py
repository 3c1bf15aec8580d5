"""`ridge bench tp`: one process against --tensor-parallel-size ranks on the same model, side by side.

For each engine (tensor_parallel_size 1, then N): its load (to ready: every rank has read its part of the file),
a batch-1 decode (a prompt of --input-len tokens prefilled, then
--output-len steps timed one by one) and a batch of --batch random requests (tok/s). For the N-rank engine, also
rank 0's time inside the step collectives (the all-reduces and the logits' gather, waiting for the other ranks
included) per decode token, and the link itself measured: the median all-reduce of one token's activations (its
latency) and of 16 MiB (its bandwidth), with which `ridge plan`'s ring all-reduce model predicts the collectives'
time per token, printed beside the measured one. Each rank runs --threads threads (default: the machine's cores
shared between the ranks), the one-process engine as many as one rank, so that the ratio isolates the split and
its communication.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ridge.bench import workloads

LINK_BIG = 4 * 2**20  # float32 values (16 MiB): the link's bandwidth


def decode_timing(engine, prompt: list[int], steps: int) -> dict:
    """Prefill `prompt`, then time `steps` decode steps one by one: ms per token, and rank 0's collective time in
    them (0 without tensor parallelism)."""
    from ridge.sampling_params import SamplingParams

    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while engine.sequences(request)[0].num_outputs == 0:
        engine.step()
    clock = getattr(getattr(engine.runner, "group", None), "clock", None)
    before = (clock.seconds, clock.calls) if clock else (0.0, 0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    after = (clock.seconds, clock.calls) if clock else (0.0, 0)
    return {"ms_per_token": 1e3 * elapsed / steps, "collective_ms_per_token": 1e3 * (after[0] - before[0]) / steps,
            "collectives_per_token": (after[1] - before[1]) / steps}


def measure(args: argparse.Namespace, ranks: int, prompt: list[int]) -> dict:
    from ridge import LLM
    from ridge.bench.cli import ridge_throughput
    from ridge.flags import engine_kwargs

    kwargs = {**engine_kwargs(args), "tensor_parallel_size": ranks, "enable_prefix_caching": False}
    if ranks == 1:  # one process holds every expert: --enable-expert-parallel is the parallel engine's
        kwargs["enable_expert_parallel"] = False
    if ranks == 1 and not kwargs.get("num_threads"):  # as many threads as one rank of the parallel engine
        from ridge.config import EngineConfig

        ranks_config = EngineConfig(model=args.model, tensor_parallel_size=args.tensor_parallel_size)
        kwargs["num_threads"] = ranks_config.threads_per_process()
    start = time.perf_counter()
    llm = LLM(args.model, progress=not args.json, **kwargs)
    load_s = time.perf_counter() - start  # to ready: every rank loaded its part and made its pool
    engine = llm.engine
    rounds = [decode_timing(engine, prompt, args.output_len) for _ in range(args.repeats)]
    row = {"ranks": ranks, "threads_per_rank": engine.config.threads_per_process(), "load_s": load_s,
           **{key: statistics.median(r[key] for r in rounds) for key in rounds[0]}}
    requests = workloads.random_requests(engine.loaded.config.vocab_size, args.batch, args.input_len,
                                         args.output_len, seed=0)
    row["batch_tok_s"] = args.batch * args.output_len / ridge_throughput(args, requests, llm).figures["elapsed_s"]
    if ranks > 1:
        # small all-reduces through shared memory where the ranks share a machine, gloo otherwise and for large ones
        row["transport"] = "shared memory" if engine.runner.group.local is not None else "gloo"
        # the latency at a decode step's own message (a token's activations), the bandwidth at 16 MiB
        latency, big = engine.runner.time_all_reduce([engine.loaded.config.hidden_size, LINK_BIG])
        steps = 2 * (ranks - 1)
        row["link"] = {"latency_us": 1e6 * latency / steps,
                       "bandwidth_gb_s": steps / ranks * LINK_BIG * 4 / max(big - latency, 1e-9) / 1e9}
        row["predicted_collective_ms_per_token"] = 1e3 * _predicted(engine, ranks, row["link"])
    llm.engine.close()
    return row


def _predicted(engine, ranks: int, link: dict) -> float:
    """`ridge plan`'s communication for one decode token over the measured link."""
    from ridge.plan.arithmetic import tp_communication
    from ridge.plan.specs import LinkSpec

    spec = engine.loaded.spec
    measured = LinkSpec("measured", link["bandwidth_gb_s"], link["latency_us"])
    return tp_communication(spec, 1, 1, ranks, measured, engine.config.torch_dtype.itemsize).seconds


def cmd_tp(args: argparse.Namespace) -> int:
    from ridge.tokenizer import RidgeTokenizer

    if args.tensor_parallel_size < 2:
        raise ValueError(f"tensor-parallel-size: {args.tensor_parallel_size}; bench tp compares 1 against at least 2")
    if args.repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {args.repeats}")
    from ridge.engine.loading import ModelFile

    tokenizer: RidgeTokenizer = ModelFile.open(args.model).tokenizer
    prompt = (tokenizer.encode("The history of the lighthouse begins with ") * args.input_len)[: args.input_len]
    rows = []
    for ranks in (1, args.tensor_parallel_size):
        print(f"[bench] tensor_parallel_size={ranks} ...", file=sys.stderr, flush=True)
        rows.append(measure(args, ranks, prompt))
    one = rows[0]
    for row in rows:
        row["decode_vs_one"] = one["ms_per_token"] / row["ms_per_token"]
        row["batch_vs_one"] = row["batch_tok_s"] / one["batch_tok_s"]
    report = {"benchmark": "tp", "model": args.model, "dtype": args.dtype, "input_len": args.input_len,
              "output_len": args.output_len, "batch": args.batch, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: one process against {args.tensor_parallel_size} tensor-parallel ranks (all-reduces "
          f"through {rows[-1]['transport']}), batch-1 decode and a batch of {args.batch}")
    for line in tp_table(report):
        print(line)
    return 0


def tp_table(report: dict) -> list[str]:
    lines = ["| ranks | threads each | load s | decode ms/token | in collectives (measured) | (plan, measured link) | "
             "collectives/token | decode vs 1 | batch tok/s | batch vs 1 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        predicted = r.get("predicted_collective_ms_per_token")
        lines.append(f"| {r['ranks']} | {r['threads_per_rank']} | {r['load_s']:.1f} | {r['ms_per_token']:.1f} | "
                     f"{r['collective_ms_per_token']:.1f} | {'-' if predicted is None else f'{predicted:.2f}'} | "
                     f"{r['collectives_per_token']:.0f} | {r['decode_vs_one']:.2f}x | {r['batch_tok_s']:.1f} | "
                     f"{r['batch_vs_one']:.2f}x |")
    link = report["rows"][-1].get("link")
    if link:
        lines.append(f"\nlink measured: {link['latency_us']:.0f} us a ring step, {link['bandwidth_gb_s']:.2f} GB/s")
    return lines


def add_tp_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("tp", help="one process against N tensor-parallel ranks: load, decode, throughput, "
                                   "all-reduce time",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.set_defaults(tensor_parallel_size=2)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed, tokens per request")
    p.add_argument("--batch", type=int, default=8, help="requests of the throughput run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 decode runs, the median kept (default 3)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_tp)
