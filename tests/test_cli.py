"""The command line, as a user runs it."""

import json
import subprocess
import sys

import pytest

RIDGE = [sys.executable, "-m", "ridge.cli"]
RANDOM_SMOLLM2 = "random:smollm2,num_layers=4,vocab_size=2048"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*RIDGE, *args], capture_output=True, text=True, check=check, timeout=600)


def in_process(capsys, *args: str) -> int:
    """`ridge ARGS` in this process (no interpreter to start): its exit status, its output left in capsys."""
    from ridge.cli import main

    try:
        return main(list(args))
    except SystemExit as exit_:  # argparse's refusals
        return exit_.code


def test_help_explains_every_command(capsys):
    out = run("--help").stdout  # once as a user starts it
    for command in ("pull", "generate", "chat", "demo", "bench"):
        assert command in out
    assert in_process(capsys, "generate", "--help") == 0 and "--kv-cache-memory" in capsys.readouterr().out
    assert in_process(capsys, "bench", "throughput", "--help") == 0 and "--peer" in capsys.readouterr().out


def test_pull_unknown_model_lists_known(smollm2_path):
    result = run("pull", "nope", check=False)
    assert result.returncode == 2 and "smollm2" in result.stderr and "qwen2.5-coder-0.5b" in result.stderr


def test_generate_json(smollm2_path, capsys):
    assert in_process(capsys, "generate", "--prompt", "What is 2+2?", "--chat", "--temperature", "0",
                      "--max-tokens", "8", "--json", "--kv-cache-memory", "64MiB") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["outputs"][0]["finish_reason"] in ("stop", "length")
    assert len(record["outputs"][0]["token_ids"]) <= 8 and record["metrics"]["ttft_s"] > 0


def test_generate_json_schema(smollm2_path, tmp_path, capsys):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert in_process(capsys, "generate", "--prompt", "What is 2+2?", "--chat", "--temperature", "0",
                      "--max-tokens", "24", "--json", "--kv-cache-memory", "64MiB",
                      "--json-schema", str(tmp_path / "schema.json")) == 0
    output = json.loads(capsys.readouterr().out)["outputs"][0]
    assert output["finish_reason"] == "stop" and isinstance(json.loads(output["text"])["answer"], int)


def test_generate_bad_value_is_a_clear_error(smollm2_path):
    result = run("generate", "--prompt", "hi", "--top-p", "1.5", check=False)
    assert result.returncode == 2 and "top_p" in result.stderr and "(0, 1]" in result.stderr
    result = run("generate", "--prompt", "hi", "--lora-modules", "a=/x", "--lora", "b", check=False)
    assert result.returncode == 2 and "lora: 'b' is not among --lora-modules (a)" in result.stderr


def test_quantize_and_bench_quant(smollm2_path, tmp_path, capsys):
    """`ridge quantize` writes a checkpoint that `generate` serves (here on int8 activations); `ridge bench
    quant` measures formats in one run and reports their bytes per step, tok/s and bandwidth fraction."""
    out = tmp_path / "int8"
    def output(*args: str) -> dict:
        assert in_process(capsys, *args) == 0
        return json.loads(capsys.readouterr().out)

    report = output("quantize", "smollm2", "--method", "rtn", "--bits", "8", "--out", str(out), "--json")
    assert report["layout"] == "gptq" and report["layers"] == 30 * 7 and (out / "config.json").exists()
    result = output("generate", "--model", str(out), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
                    "--json", "--kv-cache-memory", "64MiB", "--dtype", "float32", "--int8-activations")
    assert len(result["outputs"][0]["token_ids"]) == 4
    for args, message in ((["quantize", "smollm2", "--method", "awq", "--bits", "8", "--out", str(tmp_path / "x")],
                           "bits"),
                          (["bench", "quant", "smollm2", "--formats", "float32,fp8+a8"], "fp8+a8 not among"),
                          (["bench", "quant", "smollm2", "--rounds", "0"], "rounds: must be at least 1, got 0"),
                          (["bench", "quant", RANDOM_SMOLLM2, "--peer", f"llamacpp={sys.executable}"],
                           "--peer: llama.cpp runs a GGUF file")):
        assert in_process(capsys, *args) != 0 and message in capsys.readouterr().err  # refused before any work
    # the formats measured on SmolLM2's shape cut to 4 layers and a 2,048-token vocabulary: no file to read
    bench = output("bench", "quant", RANDOM_SMOLLM2, "--formats", "float32,int4+a8,int4+a8+eager,gguf",
                   "--baseline", "float32", "--dtype", "float32", "--output-len", "4", "--input-len", "16",
                   "--batch", "2", "--repeats", "1", "--rounds", "2", "--json", "--plot", str(tmp_path / "formats.png"),
                   "--kv-cache-memory", "64MiB")
    assert (tmp_path / "formats.png").stat().st_size > 0
    rows = {row["name"]: row for row in bench["formats"]}
    assert "a random model has no file" in rows.pop("gguf")["error"]  # a row that says why, beside the others
    assert rows["int4+a8"]["weight_bytes"] < rows["float32"]["weight_bytes"] / 3  # in float32, a byte per code
    assert rows["float32"]["decode_vs_baseline"] == 1.0
    assert "int8 activations, computes in float32" in rows["int4+a8"]["weights"]
    assert rows["int4+a8+eager"]["weight_bytes"] == rows["int4+a8"]["weight_bytes"]
    assert all(row["decode_tok_s"] > 0 and row["read_fraction"] > 0 and row["batch_tok_s"] > 0
               for row in rows.values())
    # two rounds: each ratio is the median (here the mean) of the two rounds' own ratios
    base, int4 = rows["float32"]["rounds"], rows["int4+a8"]["rounds"]
    assert len(base) == len(int4) == 2
    per_round = [i[1] / b[1] for i, b in zip(int4, base, strict=True)]
    assert abs(rows["int4+a8"]["batch_vs_baseline"] - sum(per_round) / 2) < 1e-9


def test_engine_flags_are_the_config_fields():
    """Each EngineConfig knob is a flag, with the field's default, and the flags build the same config."""
    import argparse
    import dataclasses

    from ridge.config import EngineConfig
    from ridge.flags import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    knobs = [f.name for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]
    assert len(knobs) > 20 and set(engine_kwargs(parser.parse_args([]))) == set(knobs)
    assert EngineConfig(model="m", **engine_kwargs(parser.parse_args([]))) == EngineConfig(model="m")
    args = parser.parse_args(["--threads", "3", "--no-enable-prefix-caching", "--quantization", "int4",
                              "--draft-model", "d", "--kv-cache-memory", "64MiB"])
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert (config.num_threads, config.enable_prefix_caching, config.quantization) == (3, False, "int4")
    assert config.speculate == "draft" and config.kv_cache_bytes == 64 * 2**20
    adapters = EngineConfig(model="m", **engine_kwargs(parser.parse_args(["--lora-modules", "a=/x", "b=/y"])))
    from ridge.lora import LoRARequest

    requests = LoRARequest.from_modules(adapters.lora_modules)
    assert adapters.enable_lora and [(r.lora_name, r.lora_int_id, r.lora_path) for r in requests] == [
        ("a", 1, "/x"), ("b", 2, "/y")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8


def test_bench_priority_serves_the_urgent_sooner_under_the_priority_policy(capsys):
    """`ridge bench priority --json`: the same workload under fcfs and priority; under priority the urgent arrivals
    displace background requests (preemptions, their tokens recomputed) and wait fewer steps for a first token."""
    assert in_process(capsys, "bench", "priority", "--model", RANDOM_SMOLLM2, "--max-num-seqs", "2", "--background",
                      "3", "--input-len", "16", "--output-len", "24", "--urgent", "2", "--urgent-input-len", "8",
                      "--urgent-output-len", "4", "--every", "6", "--warmup", "4", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    fcfs, ranked = report["rows"]
    assert (fcfs["policy"], ranked["policy"]) == ("fcfs", "priority")
    assert fcfs["preemptions"] == fcfs["recomputed_tokens"] == 0
    assert ranked["preemptions"] >= 2 and ranked["recomputed_tokens"] > 0
    assert ranked["urgent_ttft_steps_mean"] < fcfs["urgent_ttft_steps_mean"]  # steps, not seconds: no timing
    assert all(r["output_tok_s"] > 0 and r["weight_read_fraction"] > 0 for r in report["rows"])
    assert in_process(capsys, "bench", "priority", "--model", RANDOM_SMOLLM2, "--scheduling-policy", "fcfs") != 0
    assert "--schedule-policy: bench priority runs fcfs and priority itself" in capsys.readouterr().err


def test_bench_lora_reports_each_variant(capsys):
    """`ridge bench lora --json`: the base model without and with --enable-lora, one adapter, the adapters mixed, each
    with its step time and the bytes a step reads (the adapters' among them)."""
    assert in_process(capsys, "bench", "lora", "--model", RANDOM_SMOLLM2, "--skip-peer", "--batch", "2",
                      "--context", "16", "--steps", "2", "--adapters", "2", "--rank", "4", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["base model, no --enable-lora", "base model, --enable-lora", "1 adapter", "2 adapters"]
    assert all(r["step_ms"] > 0 and r["read_fraction"] > 0 for r in rows.values())
    assert rows["2 adapters"]["step_bytes"] > rows["1 adapter"]["step_bytes"] > rows["base model, --enable-lora"][
        "step_bytes"] == rows["base model, no --enable-lora"]["step_bytes"]
