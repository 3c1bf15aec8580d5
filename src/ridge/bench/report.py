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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ridge.kernels.cpu_ops import cpu_flags


@dataclass(frozen=True)
class Section:
    command: tuple[str, ...]  # ridge's arguments; --json is added
    table: Callable[[dict], list[str]]  # a command's JSON report -> the markdown table's rows


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


SECTIONS: dict[str, Section] = {
    "latency": Section(("bench", "latency", "--all-peers"), latency_table),
    "throughput": Section(("bench", "throughput", "--all-peers"), throughput_table),
    "formats": Section(("bench", "quant", "smollm2", "--formats", "bfloat16,gguf,int8,int4", "--rounds", "3"),
                       formats_table),
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
    return commit + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_section(name: str, results: Path) -> None:
    """Run a section's command and keep its report, with where and when it ran."""
    command = [*SECTIONS[name].command, "--json"]
    done = subprocess.run([sys.executable, "-m", "ridge.cli", *command], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`ridge {' '.join(command)}` failed ({done.returncode}): {done.stderr[-2000:]}")
    results.mkdir(parents=True, exist_ok=True)
    kept = {"command": "ridge " + " ".join(SECTIONS[name].command), "commit": _commit(),
            "date": datetime.date.today().isoformat(), "machine": _machine(), "report": json.loads(done.stdout)}
    (results / f"{name}.json").write_text(json.dumps(kept, indent=2) + "\n")


def render(page: str, results: Path) -> tuple[str, list[str]]:
    """The page with each marked section's table rendered from its kept result; and the sections rendered."""
    rendered = []

    def fill(match: re.Match) -> str:
        name = match.group(1)
        kept_path = results / f"{name}.json"
        if name not in SECTIONS or not kept_path.exists():
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
    text, rendered = render(page.read_text(), results)
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
