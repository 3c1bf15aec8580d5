"""`ridge bench serve`: an async load generator for any OpenAI-compatible server (ridge, vllm, llama.cpp).

Requests go to /v1/completions as token ids (every server gets exactly the same prompts), streamed,
with Poisson arrivals at --request-rate (or all at once) under an optional concurrency cap. Per request
it records TTFT (first streamed text), the gaps between chunks (ITL), TPOT ((E2E - TTFT) / (tokens - 1))
and E2E latency; goodput counts the requests per second that meet every --goodput SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from ridge.bench import workloads


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0  # as the server's usage reports them (prompt_tokens_details.cached_tokens)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] | None = None  # the reply's, where the request asked for them (return_token_ids)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def build_requests(args: argparse.Namespace) -> list[workloads.Request]:
    from ridge.hub import resolve
    from ridge.tokenizer import RidgeTokenizer

    tokenizer = RidgeTokenizer.from_path(resolve(args.tokenizer or args.model))
    if args.workload == "sharegpt":
        return workloads.sharegpt(tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len)
    if args.workload == "multiturn":  # --num-prompts conversations
        return workloads.multiturn(tokenizer, args.num_prompts, args.max_turns, args.max_prompt_len,
                                   args.max_output_len)
    if args.workload == "chat":  # --num-prompts conversations
        return workloads.chat_requests(tokenizer.vocab_size, args.num_prompts, args.max_turns, args.input_len,
                                       args.output_len, args.seed)
    if args.workload == "random":
        return workloads.random_requests(tokenizer.vocab_size, args.num_prompts, args.input_len, args.output_len,
                                         args.seed)
    return workloads.prefix_requests(tokenizer.vocab_size, args.num_prompts, args.prefix_len, args.input_len,
                                     args.output_len, args.prefix_fraction, args.seed)


async def _one(http: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult) -> None:
    start = time.perf_counter()
    last = start
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                choices = chunk.get("choices") or []
                if choices and result.token_ids is not None:
                    result.token_ids += choices[0].get("token_ids") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.e2e_s = time.perf_counter() - start
        if result.output_tokens == 0:  # a server without usage in streams: count the chunks
            result.output_tokens = len(result.itl_s) + (1 if result.ttft_s else 0)
        result.ok = result.ttft_s > 0
        if not result.ok:
            result.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)


async def run_load(base_url: str, model: str | None, requests: list[workloads.Request], request_rate: float,
                   max_concurrency: int | None, ignore_eos: bool, seed: int, api_key: str | None = None,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    results = [RequestResult(len(r.prompt_ids), r.max_tokens) for r in requests]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=not progress)

    async def send(http: httpx.AsyncClient, chain: list[int]) -> None:
        """A session's requests in order, each sent once the previous one is answered (after its prompt and reply,
        where it continues the conversation)."""
        conversation: list[int] = []
        for n, i in enumerate(chain):
            r, result = requests[i], results[i]
            prompt = conversation + r.prompt_ids if r.continues else r.prompt_ids
            body = {"prompt": prompt, "max_tokens": r.max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
            if model:
                body["model"] = model
            if n + 1 < len(chain) and requests[chain[n + 1]].continues:  # the next turn repeats this reply
                body["return_token_ids"], result.token_ids = True, []
            result.prompt_len = len(prompt)
            async with limit:
                await _one(http, url, body, result)
            bar.update(1)
            if result.token_ids is not None:
                if result.ok and not result.token_ids:
                    result.ok = False
                    result.error = "the reply had no token_ids (return_token_ids), which the next turn repeats"
                if not result.ok:  # the conversation cannot go on without this reply
                    for later in chain[n + 1:]:
                        results[later].error = f"an earlier turn failed: {result.error}"
                    bar.update(len(chain) - n - 1)
                    return
                conversation = prompt + result.token_ids

    chains: dict[object, list[int]] = {}  # session -> its requests; a request without one is a session alone
    for i, r in enumerate(requests):
        chains.setdefault(("session", r.session) if r.session is not None else i, []).append(i)

    timeout = httpx.Timeout(None, connect=30)
    connections = httpx.Limits(max_connections=max_concurrency or len(requests) + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=connections, headers=headers) as http:
        start = time.perf_counter()
        tasks = []
        for chain in chains.values():  # the request rate paces the sessions' starts
            tasks.append(asyncio.create_task(send(http, chain)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
        ordered = sorted(values)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

        return {"mean_ms": statistics.fmean(values) * 1e3, "median_ms": statistics.median(values) * 1e3,
                "p90_ms": pct(0.90), "p99_ms": pct(0.99)}

    def good(r: RequestResult) -> bool:
        measured = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2e_s}
        return all(measured[name] * 1e3 <= limit for name, limit in goodput.items())

    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "total_output_tokens": output_tokens, "total_prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,  # 0 from a server that does not report them
        "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "ttft": stats([r.ttft_s for r in done]), "tpot": stats([r.tpot_s for r in done if r.output_tokens > 1]),
        "itl": stats([gap for r in done for gap in r.itl_s]), "e2el": stats([r.e2e_s for r in done]),
        "goodput": sum(good(r) for r in done) / duration if goodput else None,
        "goodput_slo_ms": goodput or None,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def ttft_by_turn(requests: list[workloads.Request], results: list[RequestResult]) -> dict[int, float] | None:
    """Mean TTFT (ms) of the served requests by their turn in their session (1 = a conversation's first), for the
    workloads of sessions (multiturn, chat): where a prefix cache pays shows as later turns' first tokens."""
    if all(r.session is None for r in requests):
        return None
    turns: dict[int, list[float]] = {}
    seen: dict[int, int] = {}
    for request, result in zip(requests, results, strict=True):
        turn = seen[request.session] = seen.get(request.session, 0) + 1
        if result.ok:
            turns.setdefault(turn, []).append(result.ttft_s * 1e3)
    return {turn: statistics.fmean(values) for turn, values in sorted(turns.items())}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slo = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slo[name] = float(value)
    return slo


def print_report(report: dict[str, Any]) -> None:
    print(f"completed {report['completed']}, failed {report['failed']} in {report['duration_s']:.1f} s")
    print(f"request throughput {report['request_throughput']:.2f} req/s, output {report['output_throughput']:.1f} "
          f"tok/s, total {report['total_token_throughput']:.1f} tok/s")
    if report["cached_prompt_tokens"]:
        print(f"prefix cache: {report['cached_prompt_tokens']} of {report['total_prompt_tokens']} prompt tokens "
              f"cached ({report['prefix_cache_hit_rate']:.0%}, as the server reports)")
    if report["goodput"] is not None:
        print(f"goodput {report['goodput']:.2f} req/s under {report['goodput_slo_ms']} (ms)")
    print(f"{'':6s} {'mean':>9s} {'median':>9s} {'p90':>9s} {'p99':>9s}  (ms)")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = report[name]
        print(f"{name:6s} {s['mean_ms']:9.1f} {s['median_ms']:9.1f} {s['p90_ms']:9.1f} {s['p99_ms']:9.1f}")
    if report.get("ttft_by_turn_ms"):
        print("ttft by turn (mean ms): " + ", ".join(f"{turn}: {ms:.0f}"
                                                    for turn, ms in report["ttft_by_turn_ms"].items()))
    for error in report["errors"]:
        print(f"error: {error}")


def parse_targets(items: list[str]) -> list[tuple[str, str]]:
    """--base-url values, NAME=URL or URL, -> [(name, url)]; the name defaults to the URL's host:port."""
    targets = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep:
            name, url = item.split("://", 1)[-1].rstrip("/"), item
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: expected URL or NAME=URL with an http(s) URL, got {item!r}")
        targets.append((name, url))
    return targets


def run_offline(model: str, requests: list[workloads.Request], ignore_eos: bool) -> dict[str, Any]:
    """The same requests through ridge's in-process engine (`ridge serve`'s defaults), all at once."""
    from ridge import LLM, SamplingParams

    llm = LLM(model)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=ignore_eos) for r in requests]
    llm.generate(requests[0].prompt_ids, params[0])  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=True)
    duration = time.perf_counter() - start
    llm.engine.check_integrity()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"duration_s": duration, "total_output_tokens": tokens, "output_throughput": tokens / duration,
            "request_throughput": len(requests) / duration}


def print_comparison(reports: list[dict[str, Any]], offline: dict[str, Any] | None) -> None:
    """One row per server; ratios are the first server's figure over each row's."""
    first = reports[0]
    print(f"\n{'server':16s} {'out tok/s':>9s} {'goodput':>8s} {'TTFT p50/p99 ms':>17s} {'TPOT p50/p99 ms':>16s}"
          f" {'tok/s ratio':>11s} {'goodput ratio':>13s}")
    for r in reports:
        ratio = first["output_throughput"] / r["output_throughput"] if r["output_throughput"] else float("nan")
        good = (f"{first['goodput'] / r['goodput']:12.2f}x" if r["goodput"] else f"{'-':>13s}")
        print(f"{r['name']:16s} {r['output_throughput']:9.1f} {r['goodput'] or 0:8.2f} "
              f"{r['ttft']['median_ms']:8.0f}/{r['ttft']['p99_ms']:<8.0f} {r['tpot']['median_ms']:7.1f}/"
              f"{r['tpot']['p99_ms']:<8.1f} {ratio:10.2f}x {good}")
    if offline is not None:
        print(f"{'ridge offline':16s} {offline['output_throughput']:9.1f}   (same requests in-process, all at once)")
        for r in reports:
            print(f"  {r['name']}: {r['output_throughput'] / offline['output_throughput']:.0%} of ridge offline")


def plot_latencies(per_request: dict[str, list[dict[str, Any]]], title: str, path: str) -> None:
    """CDFs of TTFT and TPOT, one line per server: where the tails part says more than the percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, results in per_request.items():
        done = [r for r in results if r["ok"]]
        ttft = sorted(r["ttft_s"] * 1e3 for r in done)
        tpot = sorted(RequestResult(**r).tpot_s * 1e3 for r in done if r["output_tokens"] > 1)
        for ax, values in ((axes[0], ttft), (axes[1], tpot)):
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    for ax, label in ((axes[0], "TTFT (ms)"), (axes[1], "TPOT (ms)")):
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def cmd_serve(args: argparse.Namespace) -> int:
    goodput = parse_goodput(args.goodput)
    targets = parse_targets(args.base_url)
    if args.offline and args.workload == "chat":
        raise ValueError("--offline: the chat workload's prompts repeat each server's own replies; run it without "
                         "--offline")
    requests = build_requests(args)
    rate = float(args.request_rate)
    reports, per_request = [], {}
    for name, url in targets:
        print(f"== {name} ({url})")
        results, duration = asyncio.run(run_load(url, args.served_model_name, requests, rate,
                                                 args.max_concurrency, args.ignore_eos, args.seed, args.api_key))
        report = {"name": name, "base_url": url, "workload": args.workload, "num_prompts": len(requests),
                  "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                  **summarize(results, duration, goodput), "ttft_by_turn_ms": ttft_by_turn(requests, results)}
        print_report(report)
        reports.append(report)
        per_request[name] = [asdict(r) for r in results]
    offline = run_offline(args.model, requests, args.ignore_eos) if args.offline else None
    if len(reports) > 1 or offline is not None:
        print_comparison(reports, offline)
    if args.plot:
        plot_latencies(per_request, f"{args.workload}, {len(requests)} requests, rate {args.request_rate}", args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": reports, "offline": offline, "requests": per_request}, f, indent=1)
        print(f"saved: {args.json}")
    return 0 if all(r["completed"] for r in reports) else 1


def add_serve_parser(bsub) -> None:
    from ridge.hub import DEFAULT_MODEL

    p = bsub.add_parser("serve", help="load-test OpenAI-compatible servers (ridge, vllm, llama.cpp) side by side",
                        description="Stream completions to each --base-url in turn, the same requests at the same "
                                    "Poisson --request-rate, and report throughput, TTFT / TPOT / ITL / E2E latency "
                                    "percentiles and goodput, then a comparison with ratios. A server with prefix "
                                    "caching keeps the prompts of an earlier run: turn its cache off (vllm: "
                                    "--no-enable-prefix-caching) or restart it between runs for a fair comparison.")
    p.add_argument("--base-url", required=True, action="append", metavar="[NAME=]URL",
                   help="a server, e.g. ridge=http://127.0.0.1:8000 (repeatable; ratios are over the first)")
    p.add_argument("--offline", action="store_true",
                   help="also run the same requests through ridge in-process (--model, default engine settings) "
                        "and print each server's throughput as a fraction of that")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="the model whose tokenizer builds the prompts")
    p.add_argument("--tokenizer", default=None, help="a different model file for the tokenizer")
    p.add_argument("--served-model-name", default=None, help="the `model` field to send (default: none)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=["sharegpt", "random", "prefix", "multiturn", "chat"], default="sharegpt",
                   help="multiturn: --num-prompts ShareGPT conversations, each replayed turn by turn with its "
                        "recorded replies; chat: --num-prompts conversations of random messages (--input-len "
                        "tokens), each turn the conversation so far with the server's own replies (--output-len "
                        "tokens; asked for with return_token_ids, which vLLM and ridge have)")
    p.add_argument("--max-turns", type=int, default=4, help="multiturn, chat: turns per conversation (at most)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: truncate prompts to this")
    p.add_argument("--max-output-len", type=int, default=1024, help="sharegpt: cap reply lengths at this")
    p.add_argument("--input-len", type=int, default=128,
                   help="random / prefix: (suffix) prompt tokens; chat: tokens of each message")
    p.add_argument("--output-len", type=int, default=128, help="random / prefix / chat: tokens to generate")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens of each prompt's prefix")
    p.add_argument("--prefix-fraction", type=float, default=1.0,
                   help="prefix: the fraction of prompts whose prefix is the shared one (default %(default)s)")
    p.add_argument("--request-rate", default="inf", help="requests per second (Poisson), or inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per request")
    p.add_argument("--goodput", nargs="*", metavar="SLO", help="SLOs as ttft:MS tpot:MS e2el:MS")
    p.add_argument("--json", default=None, metavar="OUT", help="save the report (and per-request data) here")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw TTFT and TPOT distributions per server here")
    p.set_defaults(func=cmd_serve)
