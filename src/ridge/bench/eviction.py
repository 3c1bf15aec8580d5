"""`ridge bench eviction`: the KV a long generation holds, and its time per token, with and without eviction.

One request generates --tokens tokens on an engine with the command's --kv-eviction (sink-window when not given;
or h2o) and its --kv-budget, --kv-sink-tokens / --kv-recent-tokens; every --every tokens the KV memory it holds
(its blocks, counted in the pool) and the time per token over the last interval are read. The plain engine (no
eviction) holds the whole context: at each of --plain-at contexts a prompt of that many tokens is prefilled
(untimed) and --steps decode steps timed, the same two figures read. Every other engine flag applies to both
(--kv-cache-dtype...), the prefix cache off. The question it answers: does
eviction keep a growing generation's memory and step time flat, and what would the same context cost without
it. What eviction does to the answers is `ridge eval needle` / `ridge eval ppl`'s question, not this one's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from tqdm import tqdm


def evicting_run(engine, tokens: int, every: int) -> list[dict]:
    """One greedy generation of `tokens` tokens from a short prompt: the KV held and ms per token every `every`."""
    from ridge.sampling_params import SamplingParams

    block_bytes = _block_bytes(engine)
    prompt = engine.tokenizer.encode("Tell me a very long story, chapter after chapter, and never stop.")
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    rows, generated, last = [], 0, (0, time.perf_counter())
    with tqdm(desc="evicting", total=tokens, unit="tok", leave=False) as bar:
        while engine.has_unfinished:
            held = engine.kv.num_blocks - engine.kv.num_free  # before the step, which may finish the request
            for delta in engine.step():
                generated += len(delta.samples[0].token_ids)
            bar.update(generated - bar.n)
            if generated - last[0] >= every or not engine.has_unfinished:
                now = time.perf_counter()
                rows.append({"tokens": len(prompt) + generated, "kv_bytes": held * block_bytes,
                             "ms_per_token": 1e3 * (now - last[1]) / max(generated - last[0], 1)})
                last = (generated, now)
    return rows


def plain_run(engine, contexts: list[int], steps: int) -> list[dict]:
    """At each context: a prompt of that many random tokens prefilled, then `steps` decode steps timed."""
    from ridge.sampling_params import SamplingParams

    vocab, rows = engine.loaded.config.vocab_size, []
    for context in tqdm(contexts, desc="plain", unit="context", leave=False):
        rng = random.Random(context)
        request = engine.add_request([rng.randrange(10, vocab - 10) for _ in range(context)],
                                     SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        while engine.sequences(request)[0].num_outputs == 0:  # the prefill, in as many chunks as it takes
            engine.step()
        held = engine.kv.num_blocks - engine.kv.num_free
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        rows.append({"tokens": context, "kv_bytes": held * _block_bytes(engine),
                     "ms_per_token": 1e3 * (time.perf_counter() - start) / steps})
        while engine.has_unfinished:
            engine.step()
    return rows


def _block_bytes(engine) -> int:
    config = engine.config
    return engine.loaded.config.kv_bytes_per_block(config.torch_dtype, config.block_size, config.kv_format)


def cmd_eviction(args: argparse.Namespace) -> int:
    from ridge import LLM
    from ridge.config import EngineConfig
    from ridge.flags import engine_kwargs

    # the plain engine takes no eviction settings (EngineConfig refuses them without a policy)
    settings = ("kv_budget", "kv_sink_tokens", "kv_recent_tokens")
    no_eviction = {name: EngineConfig.__dataclass_fields__[name].default for name in settings}
    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False}
    kwargs["max_model_len"] = max(args.tokens + 64, max(args.plain_at) + args.steps + 2)
    policy = kwargs["kv_eviction"] if kwargs["kv_eviction"] != "none" else "sink-window"
    evicting = LLM(args.model, progress=not args.json, **{**kwargs, "kv_eviction": policy})
    print(f"[bench] generating {args.tokens} tokens with {policy} eviction ...", file=sys.stderr)
    rows = {policy: evicting_run(evicting.engine, args.tokens, args.every)}
    config = evicting.engine.config
    del evicting
    plain = LLM(args.model, progress=not args.json, **{**kwargs, **no_eviction, "kv_eviction": "none"})
    print(f"[bench] plain cache at contexts {args.plain_at} ...", file=sys.stderr)
    rows["none"] = plain_run(plain.engine, args.plain_at, args.steps)
    report = {"benchmark": "eviction", "model": args.model, "kv_eviction": policy, "kv_budget": config.kv_budget,
              "kv_sink_tokens": config.kv_sink_tokens if policy == "sink-window" else None,
              "kv_recent_tokens": config.eviction.recent_tokens if policy == "h2o" else None,
              "kv_cache_dtype": plain.engine.config.kv_cache_dtype, "rows": rows}
    if args.plot:
        plot_eviction(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    kept = (f"sinks {report['kv_sink_tokens']}" if policy == "sink-window"
            else f"recent {report['kv_recent_tokens']}")
    print(f"\n{args.model}: one generation with {policy} eviction (budget {report['kv_budget']} tokens, {kept}), "
          "against the plain cache at the same contexts")
    for line in eviction_table(report):
        print(line)
    return 0


def eviction_table(report: dict) -> list[str]:
    lines = ["| KV eviction | tokens in the sequence | KV held (MiB) | decode ms per token |", "|---|---:|---:|---:|"]
    for policy, rows in report["rows"].items():
        lines += [f"| {policy} | {r['tokens']:,} | {r['kv_bytes'] / 2**20:,.1f} | {r['ms_per_token']:.1f} |"
                  for r in rows]
    return lines


def plot_eviction(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, rows in report["rows"].items():
        label = f"{policy}, budget {report['kv_budget']}" if policy != "none" else "no eviction"
        xs = [r["tokens"] for r in rows]
        memory.plot(xs, [r["kv_bytes"] / 2**20 for r in rows], marker="o", label=label)
        speed.plot(xs, [r["ms_per_token"] for r in rows], marker="o", label=label)
    memory.set_ylabel("KV cache held (MiB)")
    speed.set_ylabel("decode ms per token (batch 1)")
    for ax in (memory, speed):
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
        ax.set_xlabel("tokens in the sequence")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: a growing generation's KV, with and without eviction", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


def add_eviction_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("eviction", help="a long generation's KV memory and time per token with eviction "
                                         "(sink-window or h2o), beside the plain cache",
                        description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--tokens", type=int, default=17000, help="tokens the evicting run generates (default %(default)s)")
    p.add_argument("--every", type=int, default=1000, help="read the figures every this many tokens")
    p.add_argument("--plain-at", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192, 16384],
                   help="contexts the plain cache is measured at (default 1024,4096,8192,16384)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed at each plain context")
    p.add_argument("--plot", default=None, metavar="PNG", help="KV held and ms per token by tokens, both caches")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_eviction)
