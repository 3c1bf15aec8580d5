"""`ridge bench router`: cache-aware routing against round-robin over the same replicas and the same workload.

--replicas ridge servers of --model start as processes (--replica-threads threads and --kv-cache-memory each), a
`ridge router` runs in front of them, and a multi-tenant workload arrives at --rate requests per second (Poisson):
--num-requests requests, each one of --tenants system prompts of --prefix-len tokens and a question of its own of
--input-len tokens, --output-len tokens out. Each policy gets fresh replicas (empty caches). Per policy: the
replicas' prefix-cache hit rate (cached prompt tokens over prompt tokens, from each response's usage), mean and p90
time to first token, throughput, and how the requests spread over the replicas; disaggregated: half the replicas
prefill, half decode, cache-aware over each half, and the KV bytes moved per request. Then what consistent hashing buys
when a replica joins: the share of the workload's tenant prefixes, and of 10,000 random ones, that a 5th replica
takes from 4 (each moved one lands on the new replica; ideal: 1/5).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys

from ridge.bench import workloads

POLICIES = ("cache-aware", "round-robin", "disaggregated")


def replica_flags(args: argparse.Namespace, role: str = "both") -> tuple[str, ...]:
    return ("--threads", str(args.replica_threads), "--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype,
            "--role", role)


def run_policy(args: argparse.Namespace, policy: str, requests: list[workloads.Request]) -> dict:
    from ridge.bench.serve import run_load
    from ridge.bench.servers import ServerSpec, running
    from ridge.cluster.router import Router, RouterConfig, serving_in_thread

    disaggregated = policy == "disaggregated"  # half the replicas prefill, half decode; cache-aware over each half
    with contextlib.ExitStack() as replicas:
        print(f"[bench] {policy}: starting {args.replicas} replicas ...", file=sys.stderr, flush=True)
        roles = ["prefill" if disaggregated and i < args.replicas // 2 else "decode" if disaggregated else "both"
                 for i in range(args.replicas)]
        started = [replicas.enter_context(running(ServerSpec(f"router-replica-{i}", "ridge", replica_flags(args, role)),
                                                  args.model)) for i, role in enumerate(roles)]
        urls = [u for u, role in zip(started, roles, strict=True) if role != "prefill"]
        prefill = [u for u, role in zip(started, roles, strict=True) if role == "prefill"]
        router = Router(RouterConfig(urls, "cache-aware" if disaggregated else policy, args.prefix_chars,
                                     prefill=prefill))
        with serving_in_thread(router) as url:
            results, duration = asyncio.run(run_load(url, "bench", requests, args.rate, None, True, args.seed,
                                                     progress=not args.json))
            by_replica = [router.replicas[u].sent for u in urls]
            kv_bytes = router.metrics.kv_bytes.collect()[0].samples[0].value
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        errors = sorted({r.error for r in results if not r.ok})
        raise RuntimeError(f"{len(results) - len(ok)} requests failed under {policy}: {errors[:3]}")
    ttfts = sorted(r.ttft_s for r in ok)
    return {"policy": policy, "hit_rate": sum(r.cached_tokens for r in ok) / sum(r.prompt_len for r in ok),
            "mean_ttft_s": statistics.mean(ttfts), "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "output_tok_s": sum(r.output_tokens for r in ok) / duration, "duration_s": duration,
            "requests_per_replica": sorted(by_replica, reverse=True),
            "prefix_routed": router.prefix_routed_share if policy != "round-robin" else None,
            "kv_transfer_bytes_per_request": kv_bytes / len(ok) if disaggregated else None}


def ring_movement(requests: list[workloads.Request], prefix_chars: int) -> dict:
    """The share of the workload's distinct prefixes, and of 10,000 random ones, a 5th replica takes from 4."""
    import random

    from ridge.cluster.hash_ring import HashRing, prefix_key

    tenants = sorted({prefix_key({"prompt": r.prompt_ids}, prefix_chars) for r in requests})
    rng = random.Random(0)
    synthetic = [f"{rng.getrandbits(64):x}" for _ in range(10_000)]
    ring = HashRing([f"http://replica-{i}" for i in range(4)])
    before = {k: ring.owners(k)[0] for k in tenants + synthetic}
    ring.add("http://replica-4")
    moved = {k for k, owner in before.items() if ring.owners(k)[0] != owner}
    assert all(ring.owners(k)[0] == "http://replica-4" for k in moved)
    return {"tenants": len(tenants), "tenants_moved": len(moved & set(tenants)),
            "random_moved_fraction": len(moved & set(synthetic)) / len(synthetic)}


def cmd_router(args: argparse.Namespace) -> int:
    from ridge.engine.loading import ModelFile

    for policy in args.policies:
        if policy not in POLICIES:
            raise ValueError(f"policies: {policy!r} is not one of {', '.join(POLICIES)}")
    if args.replicas < 2:
        raise ValueError(f"replicas: {args.replicas}; routing needs at least 2")
    vocab = ModelFile.open(args.model).tokenizer.vocab_size
    requests = workloads.tenant_requests(vocab, args.num_requests, args.tenants, args.prefix_len, args.input_len,
                                         args.output_len, args.seed)
    rows = [run_policy(args, policy, requests) for policy in args.policies]
    report = {"benchmark": "router", "model": args.model, "replicas": args.replicas, "rate": args.rate,
              "tenants": args.tenants, "prefix_len": args.prefix_len, "num_requests": args.num_requests,
              "policies": rows, "adding_a_replica": ring_movement(requests, args.prefix_chars)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: {args.replicas} replicas, {args.num_requests} requests at {args.rate:g}/s from "
          f"{args.tenants} tenants' {args.prefix_len}-token system prompts")
    for line in router_table(report):
        print(line)
    return 0


def router_table(report: dict) -> list[str]:
    lines = ["| policy | prefix-cache hit rate | mean TTFT (s) | p90 TTFT (s) | output tok/s | requests per replica | "
             "sent to the prefix's owner | KV moved per request |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in report["policies"]:
        owner = "-" if r["prefix_routed"] is None else f"{r['prefix_routed']:.0%}"
        moved = r.get("kv_transfer_bytes_per_request")
        lines.append(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['mean_ttft_s']:.2f} | {r['p90_ttft_s']:.2f} | "
                     f"{r['output_tok_s']:.1f} | {', '.join(map(str, r['requests_per_replica']))} | {owner} | "
                     f"{'-' if moved is None else f'{moved / 2**20:.1f} MiB'} |")
    move = report["adding_a_replica"]
    lines.append(f"\nadding a 5th replica to 4 moves {move['tenants_moved']} of the {move['tenants']} tenant prefixes "
                 f"and {move['random_moved_fraction']:.1%} of 10,000 random ones (ideal 20%), each to the new one")
    return lines


def add_router_parser(bsub) -> None:
    from ridge.cluster.router_config import RouterConfig

    defaults = RouterConfig(["-"])
    p = bsub.add_parser("router", help="cache-aware routing against round-robin over N ridge replicas",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "-m", default="smollm2", help="(default %(default)s)")
    p.add_argument("--replicas", type=int, default=4, help="(default %(default)s)")
    p.add_argument("--replica-threads", type=int, default=1, help="torch threads of each replica (default 1)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="each replica's (default %(default)s)")
    p.add_argument("--dtype", default="auto", help="(default %(default)s)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                   help="comma-separated, run in this order (default cache-aware,round-robin,disaggregated: half the "
                        "replicas --role prefill, half --role decode)")
    p.add_argument("--prefix-chars", type=int, default=defaults.prefix_chars,
                   help="the router's: leading characters of a prompt that choose its replica, a token id counting "
                        "4 (default %(default)s); below a tenant's prefix, or the tenant's requests scatter")
    p.add_argument("--tenants", type=int, default=16, help="system prompts (default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of each system prompt (default %(default)s)")
    p.add_argument("--input-len", type=int, default=32, help="tokens of each question (default %(default)s)")
    p.add_argument("--output-len", type=int, default=16, help="tokens out (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=256, help="(default %(default)s)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, Poisson (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_router)
