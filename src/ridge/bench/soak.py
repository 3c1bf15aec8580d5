"""`ridge bench soak`: a long mixed load on a server, watching that nothing leaks and nothing drifts.

It starts `ridge serve` (or uses --base-url and --pid), then sends N requests at a fixed concurrency: a
mix of streamed and plain, greedy and sampled with n > 1, and a fraction the client abandons midway
(a stream closed after a few chunks, a plain request timed out). While it runs it samples the server's
resident memory (its process and the engine's) and the KV-cache usage from /metrics. At the end it
reports failures, RSS growth from the first tenth of the run to the last, whether the KV usage came
back to 0, and whether greedy answers to a repeated prompt were all the same (they must be, in float32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm


@dataclass
class Sample:
    t: float
    rss_mib: float  # the server and its children
    server_rss_mib: float  # the server's process alone (the rest is the engine core's)
    kv_usage: float
    completed: int


@dataclass
class SoakReport:
    requests: int
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    greedy_prompts_repeated: int = 0
    greedy_prompts_diverged: int = 0
    duration_s: float = 0.0
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    server_rss_start_mib: float = 0.0
    server_rss_end_mib: float = 0.0
    kv_usage_end: float | None = None
    samples: list[Sample] = field(default_factory=list)


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory of a process and of it with its children (the server and its engine core), from /proc."""
    own, total, stack = 0, 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            total += kib
            own = kib if p == pid else own
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return own / 1024, total / 1024


async def kv_usage(http: httpx.AsyncClient) -> float:
    """The fraction of KV blocks in use, as /metrics last reported it (0 before the first step)."""
    text = (await http.get("/metrics")).text
    line = next((line for line in text.splitlines() if line.startswith("ridge:kv_cache_usage_perc")), None)
    return float(line.split()[-1]) if line is not None else 0.0


async def one(http: httpx.AsyncClient, body: dict[str, Any], abort_after: int | None) -> tuple[str, list[str]]:
    """('ok' | 'aborted' | an error, the texts of the choices when ok)."""
    try:
        if not body["stream"]:
            timeout = 0.05 * abort_after if abort_after is not None else None
            try:
                response = await http.post("/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                return ("aborted" if abort_after is not None else "timeout"), []
            if response.status_code != 200:
                return f"HTTP {response.status_code}", []
            return "ok", [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
        texts: dict[int, str] = {}
        chunks = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}", []
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                try:
                    event = json.loads(line[6:])
                except json.JSONDecodeError:  # the last, partial line of a connection closed mid-event
                    return "stream cut mid-event", []
                if "error" in event:
                    return f"stream error {event['error'].get('code')}", []
                for c in event.get("choices", []):
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    return "aborted", []  # leaving the block closes the connection mid-stream
        return "ok", [texts[i] for i in sorted(texts)]
    except httpx.HTTPError as exc:
        return type(exc).__name__, []


async def soak(base_url: str, pid: int | None, vocab: int, args: argparse.Namespace, api_key: str | None
               ) -> SoakReport:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randrange(8, args.max_prompt_len))]
               for _ in range(args.distinct_prompts)]
    report = SoakReport(args.requests)
    greedy: dict[tuple[int, int], set[str]] = {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=args.requests, desc="soak", unit="req")
    start = time.perf_counter()

    async def request(i: int, http: httpx.AsyncClient) -> None:
        prompt = rng.randrange(len(prompts))
        sampled = rng.random() < args.n_fraction
        max_tokens = rng.randrange(4, args.max_tokens + 1)
        body = {"prompt": prompts[prompt], "max_tokens": max_tokens, "stream": rng.random() < args.stream_fraction,
                "ignore_eos": True, "temperature": 0.8 if sampled else 0.0, "n": rng.randrange(2, 5) if sampled else 1,
                "seed": i}
        abort_after = rng.randrange(1, 8) if rng.random() < args.abort_fraction else None
        async with limit:
            outcome, texts = await one(http, body, abort_after)
        if outcome == "ok":
            report.completed += 1
            if not sampled:
                greedy.setdefault((prompt, max_tokens), set()).add(texts[0])
        elif outcome == "aborted":
            report.aborted += 1
        else:
            report.failed += 1
            report.errors[outcome] = report.errors.get(outcome, 0) + 1
        bar.update(1)

    async def watch(http: httpx.AsyncClient) -> None:
        while True:
            server, total = rss_mib(pid) if pid else (0.0, 0.0)
            report.samples.append(Sample(time.perf_counter() - start, total, server, await kv_usage(http),
                                         report.completed))
            await asyncio.sleep(args.sample_every)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None, connect=30),
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
        watcher = asyncio.create_task(watch(http))
        await asyncio.gather(*(request(i, http) for i in range(args.requests)))
        deadline = time.monotonic() + 30  # abandoned requests are freed within a step; the usage settles
        while (usage := await kv_usage(http)) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        watcher.cancel()
        report.kv_usage_end = usage
    bar.close()
    report.duration_s = time.perf_counter() - start
    _summarize(report, greedy)
    return report


def _summarize(report: SoakReport, greedy: dict[tuple[int, int], set[str]]) -> None:
    """Memory at the start and the end (medians of the first and last tenth of the samples), and how many
    greedy prompts asked more than once came back with more than one text."""
    rss = [s.rss_mib for s in report.samples]
    tenth = max(1, len(rss) // 10)
    report.rss_start_mib, report.rss_end_mib = statistics.median(rss[:tenth]), statistics.median(rss[-tenth:])
    server = [s.server_rss_mib for s in report.samples]
    report.server_rss_start_mib = statistics.median(server[:tenth])
    report.server_rss_end_mib = statistics.median(server[-tenth:])
    report.greedy_prompts_repeated = len(greedy)
    report.greedy_prompts_diverged = sum(len(texts) > 1 for texts in greedy.values())


def plot(report: SoakReport, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in report.samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    top.plot(t, [s.rss_mib for s in report.samples], label="server + engine core")
    top.plot(t, [s.rss_mib - s.server_rss_mib for s in report.samples], label="engine core")
    top.plot(t, [s.server_rss_mib for s in report.samples], label="server")
    top.legend(loc="center right")
    top.set_ylabel("RSS, server + engine (MiB)")
    middle.plot(t, [100 * s.kv_usage for s in report.samples], color="tab:orange")
    middle.set_ylabel("KV cache in use (%)")
    bottom.plot(t, [s.completed for s in report.samples], color="tab:green")
    bottom.set_ylabel("requests completed")
    bottom.set_xlabel("minutes")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved: {path}")


def cmd_soak(args: argparse.Namespace) -> int:
    from ridge.hub import resolve
    from ridge.serve.server import free_port
    from ridge.tokenizer import RidgeTokenizer

    vocab = RidgeTokenizer.from_path(resolve(args.model)).vocab_size
    server = None
    base_url, pid = args.base_url, args.pid
    if base_url is None:
        port = free_port()
        command = [sys.executable, "-m", "ridge.cli", "serve", "--model", args.model, "--port", str(port),
                   "--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype, *shlex.split(args.server_args)]
        log = open(args.server_log, "w")  # noqa: SIM115 - the server's whole life
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        print(f"ridge serve on port {port}, its log in {args.server_log}")
        base_url, pid = f"http://127.0.0.1:{port}", server.pid
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(command)}` did not come up")
            time.sleep(0.5)
    try:
        report = asyncio.run(soak(base_url, pid, vocab, args, args.api_key))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    growth = report.rss_end_mib - report.rss_start_mib
    print(f"{report.requests} requests in {report.duration_s / 60:.1f} min: {report.completed} completed, "
          f"{report.aborted} abandoned by the client, {report.failed} failed {report.errors or ''}")
    print(f"RSS (server + engine): {report.rss_start_mib:.0f} MiB over the first tenth, {report.rss_end_mib:.0f} MiB "
          f"over the last ({growth:+.0f} MiB), of which the server's process {report.server_rss_start_mib:.0f} -> "
          f"{report.server_rss_end_mib:.0f} MiB; KV cache in use at the end: {100 * (report.kv_usage_end or 0):.1f}%")
    print(f"greedy answers to repeated prompts: {report.greedy_prompts_diverged} of "
          f"{report.greedy_prompts_repeated} prompts got more than one distinct answer")
    if args.plot:
        plot(report, args.plot, f"soak: {report.requests} requests, concurrency {args.concurrency}, "
                                f"{args.abort_fraction:.0%} abandoned ({args.dtype})")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1))
        print(f"saved: {args.json}")
    return 0 if report.failed == 0 and not report.kv_usage_end else 1


def add_soak_parser(bsub) -> None:
    from ridge.hub import DEFAULT_MODEL

    p = bsub.add_parser("soak", help="a long mixed load: failures, RSS and KV usage over time, greedy repeats",
                        description="Start `ridge serve` (or use --base-url and --pid) and send --requests completions "
                                    "at --concurrency: streamed and plain, greedy and sampled with n 2-4, a fraction "
                                    "abandoned by the client midway. Samples RSS and KV usage while it runs; exits 1 "
                                    "if a request failed or KV blocks were still held at the end.")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL)
    p.add_argument("--base-url", default=None, help="a running ridge server (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="with --base-url: the server's PID, for its RSS")
    p.add_argument("--server-log", default="ridge-soak-server.log", help="the started server's output")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default="bfloat16", help="the started server's dtype (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="64MiB", help="the started server's pool (default %(default)s)")
    p.add_argument("--server-args", default="",
                   help="more flags for the started server, as one string: --server-args=\"--batch-invariant\"")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--abort-fraction", type=float, default=0.1, help="requests the client abandons midway")
    p.add_argument("--n-fraction", type=float, default=0.2, help="requests sampled with n 2-4 (the rest greedy)")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 4 to this many tokens")
    p.add_argument("--max-prompt-len", type=int, default=200)
    p.add_argument("--distinct-prompts", type=int, default=40, help="prompts are drawn from this many, so that "
                                                                     "greedy answers repeat and can be compared")
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between RSS / KV samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--json", default=None, metavar="OUT")
    p.set_defaults(func=cmd_soak)
