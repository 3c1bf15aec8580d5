"""`ridge bench capacity`: how many sequences of a given context the engine's KV pool holds, with sliding
windows honoured and with every layer kept whole (--ignore-sliding-window), or in each KV cache format
(--kv-cache-dtypes auto,fp8,int8,int4), side by side with the plan.

Measured, not computed: each mode builds the engine and fills its pool through the engine's own KV manager,
sequence after sequence, with the reservations and commits a chunked prefill makes (so window groups drop
their blocks exactly as they do while serving), until a reservation fails. No forward pass runs: the pool's
accounting does not depend on the K/V values, and an 8k prefill per sequence would take minutes on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

from tqdm import tqdm

from ridge.engine.sequence import Sequence
from ridge.sampling_params import SamplingParams


def fill(engine, context: int) -> dict:
    """Sequences of `context` tokens admitted until the pool is full; what one of them holds."""
    kv, chunk = engine.kv, engine.config.max_num_batched_tokens
    rng = random.Random(0)
    held: list[Sequence] = []
    per_sequence_blocks = None
    with tqdm(desc="fill", unit="seq", leave=False) as bar:
        while True:
            seq = Sequence(seq_id=len(held), request_id=str(len(held)), index=0, prompt_len=context,
                           token_ids=[rng.randrange(10, 1000) for _ in range(context)], params=SamplingParams())
            if not _prefill(kv, seq, chunk):
                kv.free(seq)
                break
            if per_sequence_blocks is None:
                per_sequence_blocks = sum(b != kv.null_block for table in seq.block_tables for b in table)
            held.append(seq)
            bar.update(1)
    kv.check_integrity(held)
    for seq in held:
        kv.free(seq)
    kv.check_idle()
    block_bytes = engine.loaded.config.kv_bytes_per_block(engine.config.torch_dtype, kv.block_size,
                                                          engine.config.kv_format)
    return {"sequences": len(held), "num_blocks": kv.num_blocks, "block_bytes": block_bytes,
            "kv_bytes_per_sequence": (per_sequence_blocks or 0) * block_bytes}


def _prefill(kv, seq: Sequence, chunk: int) -> bool:
    """Reserve and commit seq's tokens in chunks, as the scheduler and the engine do for a prompt."""
    while seq.num_computed < len(seq.token_ids):
        n = min(chunk, len(seq.token_ids) - seq.num_computed)
        if not kv.reserve(seq, seq.num_computed + n):
            return False
        kv.commit(seq, n)
    return True


def cmd_capacity(args: argparse.Namespace) -> int:
    from ridge.config import EngineConfig
    from ridge.engine.engine import LLMEngine
    from ridge.flags import engine_kwargs
    from ridge.plan.arithmetic import kv_bytes

    base = EngineConfig(args.model, **engine_kwargs(args))
    plain = "bf16" if base.torch_dtype.itemsize == 2 else "fp32"
    if args.kv_cache_dtypes:  # one mode per cache format, against the first
        modes = [(f"kv {name}", dataclasses.replace(base, kv_cache_dtype=name), plain if name == "auto" else name)
                 for name in args.kv_cache_dtypes.split(",")]
    else:  # sliding windows against every layer whole
        modes = [("windows honoured", base, plain),
                 ("every layer whole", dataclasses.replace(base, ignore_sliding_window=True), plain)]
    rows = []
    for name, config, kv_dtype in modes:
        config = dataclasses.replace(config, enable_prefix_caching=False, max_model_len=args.context + 1)
        engine = LLMEngine(config, progress=not args.json)
        spec = engine.loaded.spec
        if config.ignore_sliding_window:
            spec = dataclasses.replace(spec, sliding_window=0)
        rows.append({"mode": name, **fill(engine, args.context),
                     "kv_bytes_per_token": kv_bytes(spec, kv_dtype, 1) if not spec.local_layers else None,
                     "plan_kv_bytes_per_sequence": kv_bytes(spec, kv_dtype, args.context)})
        del engine
    for row in rows:
        row["sequences_ratio"] = row["sequences"] / max(rows[0]["sequences"], 1)
    report = {"model": args.model, "context": args.context, "kv_cache_memory": base.kv_cache_bytes, "modes": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: sequences of {args.context} tokens in {base.kv_cache_bytes / 2**20:.0f} MiB of KV cache, "
          "filled through the engine's KV manager")
    print(f"{'mode':20s} {'sequences':>9s} {'ratio':>6s} {'KV per seq (engine)':>20s} {'KV per seq (plan)':>18s}")
    for m in rows:
        print(f"{m['mode']:20s} {m['sequences']:9d} {m['sequences_ratio']:5.2f}x "
              f"{m['kv_bytes_per_sequence'] / 2**20:16.1f} MiB {m['plan_kv_bytes_per_sequence'] / 2**20:14.1f} MiB")
    return 0


def add_capacity_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("capacity", help="sequences of a context that fit in the KV pool, sliding windows honoured "
                                         "vs every layer whole, with the KV bytes per sequence (engine and plan)",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence (default %(default)s)")
    p.add_argument("--kv-cache-dtypes", metavar="LIST", help="compare KV cache formats instead of windows, e.g. "
                   "auto,fp8,int8,int4 (the ratio is against the first)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_capacity)
