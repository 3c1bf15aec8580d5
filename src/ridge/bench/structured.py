"""`ridge bench structured`: what a grammar costs. A batch decoded with JSON-schema constraints against the same
batch unconstrained, in one run (interleaved rounds, medians), and the time to first token of a request whose
schema is new (compiled then) and of one whose schema is cached.

Both runs keep the whole batch for every step: the schemas ask for more than the output has room for (a story
of at least 2,000 characters, a list of at least 200 numbers), so no constrained sequence ends early, and the
unconstrained one ignores its end-of-turn token. The share of the step spent filling masks is measured inside
the engine (engine/structured.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = [
    {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 2000}},
     "required": ["title", "story"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 200},
    {"type": "object", "properties": {"people": {"type": "array", "minItems": 50, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}}, "required": ["people"]},
]
QUESTIONS = ["Write a long story about the sea.", "List many numbers.", "Describe the people of a village.",
             "Tell me about a lighthouse keeper.", "Give me data about a city."]


def cmd_structured(args: argparse.Namespace) -> int:
    from ridge import LLM, SamplingParams, StructuredOutputsParams
    from ridge.flags import engine_kwargs

    llm = LLM(args.model, progress=not args.json, **engine_kwargs(args))
    grammars = llm.engine.grammars
    prompts = [llm.render_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Reply in JSON."}])
               for i in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
                   for i in range(args.batch)]
    llm.generate(prompts, constrained)  # warm-up: tokenizer view, compiled grammars, prefix cache
    runs: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    mask_seconds, tokens = [], args.batch * args.max_tokens
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("json schema", constrained)):
            masks_before = grammars.mask_seconds
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            runs[name].append(time.perf_counter() - started)
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            if produced != tokens:
                raise RuntimeError(f"{name}: {produced} tokens where the batch keeps {tokens}: a schema ended early")
            if name == "json schema":
                mask_seconds.append(grammars.mask_seconds - masks_before)
    seconds = {name: statistics.median(times) for name, times in runs.items()}
    slowdown = seconds["json schema"] / seconds["unconstrained"]
    mask_share = statistics.median(mask_seconds) / seconds["json schema"]

    def ttft(schema: dict | None) -> float:
        structured = StructuredOutputsParams(json=schema) if schema is not None else None
        (out,) = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=1, structured_outputs=structured))
        return out.metrics["ttft_s"]

    fresh = {"type": "object", "properties": {f"field{time.time_ns()}": {"type": "string"}}}  # never compiled
    first = {"new schema": ttft(fresh), "cached schema": ttft(fresh), "unconstrained": ttft(None)}
    report = {"model": args.model, "batch": args.batch, "output_tokens": args.max_tokens, "rounds": args.rounds,
              "seconds": seconds, "tok_s": {k: tokens / v for k, v in seconds.items()}, "slowdown": slowdown,
              "mask_share_of_step": mask_share, "ttft_s": first, "grammar_engine": "llguidance"}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: batch {args.batch}, {args.max_tokens} tokens each, greedy, median of {args.rounds}")
    for name, value in seconds.items():
        print(f"  {name:14s} {tokens / value:8.1f} tok/s")
    print(f"  json schema costs {100 * (slowdown - 1):+.1f}% per step; filling the masks takes "
          f"{100 * mask_share:.1f}% of the constrained run")
    print("  time to first token: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in first.items()))
    return 0


def add_structured_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("structured", help="what a JSON-schema constraint costs per decode step, and in TTFT",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--batch", type=int, default=32, help="requests decoded together (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds for medians (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_structured)
