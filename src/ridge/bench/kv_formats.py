"""`ridge bench kv`: KV cache formats side by side (--kv-cache-dtype auto, fp8, int8, int4), in one run.

For each format, on the same model: the bytes a token of context takes in the cache, a sequence of --context
tokens' cache over its tokens (windowed layers hold their window only; the engine's whole blocks, and `ridge
plan`'s count), how many sequences of --context tokens the pool of --kv-cache-memory holds (filled through the
engine's KV manager, as `ridge bench capacity` does), and the decode time per step of --batch sequences at that
context (the prompts prefilled first, untimed; then --steps decode steps timed), with the bytes a step must read
(weights and every sequence's cache) as a fraction of the machine's measured read bandwidth; with --agreement N,
how many greedy answers to N chat questions stay the first format's token for token, and where the others part,
the first format's logprob margin between its two best tokens (a near-tie when small). The question it
answers: what does each format buy in capacity and in decode speed at a long context, where the cache, not the
weights, is most of what a step reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from tqdm import tqdm

from ridge.bench.capacity import fill
from ridge.plan import arithmetic, roofline


def decode_step_ms(engine, context: int, batch: int, steps: int, adapters: list | None = None) -> float:
    """Median ms of a decode step of `batch` sequences of `context` tokens (prompts of random tokens): the prompts
    prefilled first (the first ones decode meanwhile), then `steps` steps of all of them decoding timed, then all
    aborted. adapters: each sequence's LoRARequest (or None), where the engine serves LoRA adapters."""
    from ridge.sampling_params import SamplingParams

    rng = random.Random(context)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=batch + steps + 2, ignore_eos=True)  # none ends while timed
    ids = [engine.add_request([rng.randrange(10, vocab - 10) for _ in range(context)], params,
                              lora_request=adapters[i] if adapters else None) for i in range(batch)]
    with tqdm(desc="prefill", total=batch, unit="seq", leave=False) as bar:
        while (done := sum(bool(engine.sequences(i)[0].num_outputs) for i in ids)) < batch:
            bar.update(done - bar.n)
            engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished:  # the aborts take effect on the next step
        engine.step()
    return 1e3 * sorted(times)[len(times) // 2]


def add_decode_step_args(p: argparse.ArgumentParser, context: int) -> None:
    """decode_step_ms's settings as flags: --context, --batch, --steps."""
    p.add_argument("--context", type=int, default=context, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences decoded together (default %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (default %(default)s)")


def decode_step_len(args: argparse.Namespace) -> int:
    """The max_model_len decode_step_ms's sequences need: the prompt, and tokens enough that none ends while timed."""
    return args.context + args.batch + args.steps + 4


def agreement(answers: list, reference: list) -> dict:
    """How many answers equal the reference's token for token; for each other, where it parts and the
    reference's margin there (its best logprob minus its second: a near-tie when small)."""
    parted = []
    for ours, theirs in zip(answers, reference, strict=True):
        if ours.token_ids == theirs.token_ids:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=False)) if a != b),
                  min(len(ours.token_ids), len(theirs.token_ids)))
        top = sorted(theirs.logprobs[min(at, len(theirs.logprobs) - 1)].values(), reverse=True)
        parted.append({"token": at, "margin": top[0] - top[1]})
    return {"equal": len(answers) - len(parted), "of": len(answers), "parted": parted}


def cmd_kv(args: argparse.Namespace) -> int:
    from ridge import LLM, SamplingParams
    from ridge.bench.workloads import sharegpt
    from ridge.config import EngineConfig
    from ridge.flags import engine_kwargs
    from ridge.linear import model_weight_bytes

    print(f"[bench] measuring the read bandwidth of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(dtypes=(), device=args.device)
    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False,
              "max_model_len": decode_step_len(args)}
    base = EngineConfig(args.model, **kwargs)
    plain = "bf16" if base.torch_dtype.itemsize == 2 else "fp32"
    greedy = SamplingParams(temperature=0, max_tokens=args.agreement_tokens, logprobs=2)
    rows, reference, chats = [], None, None
    for name in args.kv_cache_dtypes:
        llm = LLM(args.model, progress=not args.json, **{**kwargs, "kv_cache_dtype": name})
        engine = llm.engine
        spec, kv_dtype = engine.loaded.spec, plain if name == "auto" else name
        row = {"kv_cache_dtype": name,
               "plan_kv_bytes_per_token": arithmetic.kv_bytes(spec, kv_dtype, args.context) / args.context}
        if args.agreement:  # the first turns of ShareGPT conversations, as chats
            if chats is None:
                questions = [engine.tokenizer.decode(r.prompt_ids)
                             for r in sharegpt(engine.tokenizer, args.agreement, max_prompt_len=256)]
                chats = [llm.render_chat([{"role": "user", "content": q}]) for q in questions]
            answers = [o.outputs[0] for o in llm.generate(chats, greedy)]
            reference = reference or answers
            row["agreement"] = agreement(answers, reference)
        capacity = fill(engine, args.context)
        ms = decode_step_ms(engine, args.context, args.batch, args.steps)
        step_bytes = model_weight_bytes(engine.loaded.model, args.batch) + args.batch * arithmetic.kv_bytes(
            spec, kv_dtype, args.context)
        row.update(kv_bytes_per_token=capacity["kv_bytes_per_sequence"] / args.context,
                   sequences=capacity["sequences"], step_ms=ms, tok_s=args.batch * 1e3 / ms, step_bytes=step_bytes)
        rows.append(row)
        del llm, engine
        roof = roofline.remeasured(roof, args.device)  # each format runs in minutes of its own
    for row in rows:
        row["read_fraction"] = row["step_bytes"] / (row["step_ms"] / 1e3) / 1e9 / roof.read_gb_s
    report = {"benchmark": "kv", "model": args.model, "context": args.context, "batch": args.batch,
              "kv_cache_memory": base.kv_cache_bytes, "agreement_tokens": args.agreement_tokens,
              "machine": dataclasses.asdict(roof), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: {args.context}-token contexts, {base.kv_cache_bytes / 2**20:.0f} MiB of KV cache, "
          f"decode at batch {args.batch}; read bandwidth {roof.read_gb_s:.1f} GB/s")
    for line in kv_table(report):
        print(line)
    return 0


def kv_table(report: dict) -> list[str]:
    rows = report["rows"]
    first = rows[0]
    agreement = "agreement" in first
    lines = ["| KV cache | bytes a token (engine / plan) | sequences that fit | vs first | decode ms a step | "
             "tok/s | vs first | MB a step reads | of read bandwidth |"
             + (" greedy answers equal to the first's | margins where they part |" if agreement else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---|" if agreement else "")]
    for r in rows:
        line = (f"| {r['kv_cache_dtype']} | {r['kv_bytes_per_token']:,.0f} / {r['plan_kv_bytes_per_token']:,.0f} | "
                f"{r['sequences']} | {r['sequences'] / max(first['sequences'], 1):.2f}x | {r['step_ms']:.1f} | "
                f"{r['tok_s']:.1f} | {first['step_ms'] / r['step_ms']:.2f}x | {r['step_bytes'] / 1e6:,.0f} | "
                f"{100 * r['read_fraction']:.0f}% |")
        if agreement:
            a = r["agreement"]
            margins = ", ".join(f"{p['margin']:.2f}" for p in sorted(a["parted"], key=lambda p: p["margin"]))
            line += f" {a['equal']} of {a['of']} | {margins or '-'} |"
        lines.append(line)
    return lines


def add_kv_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("kv", help="KV cache formats side by side: bytes a token, sequences that fit, decode time "
                                   "at a long context", description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--kv-cache-dtypes", type=lambda s: s.split(","), default=["auto", "fp8", "int8", "int4"],
                   help="formats to compare, the first the baseline (default auto,fp8,int8,int4)")
    add_decode_step_args(p, context=8192)
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="also answer N ShareGPT questions greedily in each format, and count the answers equal to the "
                        "first format's token for token (with the first's logprob margin where one parts)")
    p.add_argument("--agreement-tokens", type=int, default=48, help="new tokens of each answer (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_kv)
