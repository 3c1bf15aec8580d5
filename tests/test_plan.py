"""`ridge plan`'s arithmetic against worked numbers from the literature, each with its arithmetic.

Bytes are decimal (GB = 1e9). Tolerances are the rounding of the quoted figure, not slack in the math.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ridge.cli import main
from ridge.models.gguf_file import read_gguf
from ridge.models.presets import model_presets, resolve_model
from ridge.models.spec import spec_from_gguf, spec_from_hf_config
from ridge.plan import arithmetic as a
from ridge.plan.report import build_plan
from ridge.plan.specs import HardwareSpec, Workload, hardware_table, override, resolve_hardware
from ridge.plan.speculation import speculation_table

PRESETS = model_presets()
H100 = hardware_table()["h100-sxm"]


def close(value: float, expected: float, rel: float) -> bool:
    return abs(value - expected) <= rel * abs(expected)


def test_qwen3_8b_has_8_19b_parameters_and_16_4_gb_in_bf16():
    # embeddings 151936*4096 = 622.3M, untied head 622.3M; per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096
    # = 41.9M, SwiGLU 3*4096*12288 = 151.0M; 36 layers -> 6.95B; total 8.19B; x 2 bytes = 16.4 GB
    m = PRESETS["qwen3-8b"]
    p = a.count_parameters(m)
    assert p.embeddings == p.output_head == 151936 * 4096
    assert p.attention == 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024)
    assert p.ffn_stored == p.ffn_active == 36 * 3 * 4096 * 12288
    assert close(p.stored, 8.19e9, 0.001)
    assert close(a.weight_bytes(m, "bf16"), 16.4e9, 0.003)


def test_qwen3_8b_kv_is_2_36_8_128_2_bytes_per_token_5_9_gb_at_40k_147_gb_at_1m():
    m = PRESETS["qwen3-8b"]
    assert a.kv_bytes_per_token(m, "bf16") == 2 * 36 * 8 * 128 * 2 == 147_456
    assert close(a.kv_bytes(m, "bf16", 40_000), 5.9e9, 0.001)  # 40,000 * 147,456 = 5.898e9
    assert close(a.kv_bytes(m, "bf16", 1_000_000), 147e9, 0.004)  # 1e6 * 147,456 = 147.5e9
    # ridge's quantized rows (kv/formats.py): a byte a value and a float16 scale a row of 128; int4: half a byte
    # a value and a scale per 32; int8 / int4 keys: a byte a channel a block of 16 instead of the row's scales
    assert a.kv_bytes_per_token(m, "fp8") == 2 * 36 * 8 * (128 + 2) == 74_880
    assert a.kv_bytes_per_token(m, "int8") == 36 * 8 * ((128 + 128 / 16) + (128 + 2)) == 76_608
    assert a.kv_bytes_per_token(m, "int4") == 36 * 8 * ((64 + 128 / 16) + (64 + 4 * 2))


def test_h100_ridge_point_is_989_tflops_over_3_35_tb_s_295_flop_per_byte():
    assert close(H100.ridge_point("bf16"), 295, 0.002)  # 989.4e12 / 3.35e12 = 295.3


def test_qwen3_8b_decode_at_40k_on_h100_is_22_gb_6_6_ms_150_tok_s():
    # the worked figure reads all 16.4 GB of weights + 5.9 GB of KV = 22.3 GB per token; / 3.35 TB/s = 6.65 ms;
    # 1 / 6.65 ms = 150 tok/s
    m = PRESETS["qwen3-8b"]
    literature = a.weight_bytes(m, "bf16") + a.kv_bytes(m, "bf16", 40_000)
    assert close(literature, 22.3e9, 0.005)
    assert close(literature / (H100.bandwidth_gb_s * 1e9), 6.65e-3, 0.01)
    assert close(1 / (literature / (H100.bandwidth_gb_s * 1e9)), 150, 0.01)
    # ridge's own count leaves out the input embedding table (a lookup reads one row per token): 1.24 GB less
    plan = build_plan(m, H100, Workload(context=40_000))
    assert plan.decode_bytes_per_token == pytest.approx(literature - 151936 * 4096 * 2, rel=1e-6)
    assert close(plan.decode.seconds, 6.28e-3, 0.01) and plan.decode.wall == "bandwidth"


def test_70b_fp16_decode_is_42_ms_per_token_on_one_h100_and_21_ms_at_int8():
    # Llama-3-70B: 70.6B parameters x 2 bytes = 141 GB / 3.35 TB/s = 42 ms; x 1 byte = 21 ms
    m = PRESETS["llama-3-70b"]
    assert close(a.count_parameters(m).stored, 70.6e9, 0.002)
    seconds = {d: a.weight_bytes(m, d) / (H100.bandwidth_gb_s * 1e9) for d in ("bf16", "int8")}
    assert close(seconds["bf16"], 42e-3, 0.01)
    assert close(seconds["int8"], 21e-3, 0.01)


def test_llama3_70b_kv_is_2_80_8_128_2_bytes_per_token():
    assert a.kv_bytes_per_token(PRESETS["llama-3-70b"], "bf16") == 2 * 80 * 8 * 128 * 2 == 327_680


def test_deepseek_v3_mla_caches_576_per_layer_2_bytes_61_layers():
    # MLA caches the 512-wide latent + the 64-wide shared rotary key: (512 + 64) * 61 * 2 = 70,272 bytes
    m = PRESETS["deepseek-v3"]
    assert a.kv_bytes_per_token(m, "bf16") == 576 * 61 * 2 == 70_272
    assert close(a.count_parameters(m).stored, 671e9, 0.002)  # the published 671B (MTP layer aside)
    assert close(a.count_parameters(m).active, 37e9, 0.02)  # and 37B activated


def test_gemma_4_counts_the_published_parameters_and_its_kv():
    """Google's figures: 31B 30.7B; 26B-A4B 25.2B, 3.8B active; E2B 5.1B, 2.3B without its embedding tables. KV per
    token: 31B's 50 windowed layers (16 KV heads of 256) and 10 global (4 of 512, keys and values both cached); E2B's
    15 caching layers of 35 (12 windowed, 3 global, 1 KV head each)."""
    assert close(a.count_parameters(PRESETS["gemma-4-31b"]).stored, 30.7e9, 0.002)
    moe = a.count_parameters(PRESETS["gemma-4-26b-a4b"])
    assert close(moe.stored, 25.2e9, 0.002) and close(moe.active, 3.8e9, 0.01)
    e2b = a.count_parameters(PRESETS["gemma-4-e2b"])
    assert close(e2b.stored, 5.1e9, 0.01) and close(e2b.stored - e2b.per_layer_table - e2b.embeddings, 2.3e9, 0.05)
    assert a.kv_bytes_per_token(PRESETS["gemma-4-31b"], "bf16") == 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)
    assert a.kv_bytes_per_token(PRESETS["gemma-4-e2b"], "bf16") == 2 * 2 * (12 * 256 + 3 * 512)
    # a decode reads every layer's cache, the shared layers' their sources': 35 layers' worth at 512 tokens
    assert a.kv_read_bytes(PRESETS["gemma-4-e2b"], "bf16", 512) == 2 * 2 * 512 * (28 * 256 + 7 * 512)


def test_qwen3_30b_a3b_stores_30_5b_and_activates_3_35b():
    # per layer: attention 2048*4096*2 + 2*2048*512 = 18.9M; 128 experts * 3*2048*768 = 604M stored, 8 active
    # = 37.7M; router 2048*128; 48 layers + 2 * 151936*2048 embeddings
    p = a.count_parameters(PRESETS["qwen3-30b-a3b"])
    assert close(p.stored, 30.5e9, 0.002)
    assert close(p.active, 3.35e9, 0.002)


def test_mixtral_stores_46_7b_and_activates_12_9b_and_reads_the_same_from_its_config():
    p = a.count_parameters(PRESETS["mixtral-8x7b"])
    assert close(p.stored, 46.7e9, 0.002) and close(p.active, 12.9e9, 0.002)
    # its config.json names experts num_local_experts and gives them the dense intermediate_size
    config = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    assert spec_from_hf_config(config, "mixtral-8x7b") == dataclasses.replace(PRESETS["mixtral-8x7b"],
                                                                              source="config.json")


def test_starcoder2_3b_stores_3_03b_and_reads_the_same_from_its_config():
    # 30 layers of attention 2 * 3072^2 + 2 * 3072 * 256 and an ungated MLP 2 * 3072 * 12288 (biases left out),
    # the embedding 49152 * 3072 tied: 3.03B
    assert close(a.count_parameters(PRESETS["starcoder2-3b"]).stored, 3.03e9, 0.002)
    config = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "vocab_size": 49152,
              "hidden_size": 3072, "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
              "intermediate_size": 12288, "hidden_act": "gelu_pytorch_tanh", "use_bias": True, "norm_epsilon": 1e-5,
              "rope_theta": 999999.4420358813, "max_position_embeddings": 16384, "sliding_window": 4096,
              "tie_word_embeddings": True}
    assert spec_from_hf_config(config, "starcoder2-3b") == dataclasses.replace(PRESETS["starcoder2-3b"],
                                                                               source="config.json")


def test_gpt_oss_stores_116_8b_and_20_9b_and_activates_5_13b_and_3_61b_past_the_embedding():
    # OpenAI's model card: 116.83B with 5.13B active, and 20.91B with 3.61B; its active count leaves out the input
    # embedding (a lookup), which ridge's counts (0.58B); ridge's count has no biases or sinks (~40M)
    for name, stored, active in (("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)):
        p = a.count_parameters(PRESETS[name])
        assert close(p.stored, stored, 0.001) and close(p.active - p.embeddings, active, 0.002)


def test_every_preset_is_a_model_the_engine_builds():
    from ridge.models.registry import config_from_spec

    for name, spec in PRESETS.items():
        assert config_from_spec(spec).num_layers == spec.num_layers, name


@pytest.mark.parametrize(("accept", "expected"), [(0.6, 2.31), (0.8, 3.36), (0.9, 4.10)])
def test_speculation_tokens_per_pass_is_1_minus_a_to_the_k_plus_1_over_1_minus_a(accept, expected):
    # k = 4: (1 - 0.6^5) / 0.4 = 2.306; (1 - 0.8^5) / 0.2 = 3.362; (1 - 0.9^5) / 0.1 = 4.095
    assert round(a.expected_tokens_per_pass(accept, 4), 2) == expected


def test_speculation_pays_at_small_batch_and_stops_paying_once_verification_is_compute_bound():
    rows = speculation_table(PRESETS["llama-3-8b"], H100, 0.6, 4, 0.1, Workload(context=128))
    assert rows[0].wall == "bandwidth" and rows[0].speedup == pytest.approx(2.306 / 1.4, rel=0.01)
    assert rows[-1].wall == "compute" and rows[-1].speedup < 1
    assert all(r.batch == 2 ** i for i, r in enumerate(rows))


def test_2_dollars_an_hour_at_2000_tok_s_is_28_cents_per_million_tokens():
    # 2000 tok/s * 3600 s = 7.2M tokens per hour; $2 / 7.2 = $0.278 per million
    assert round(a.cost_per_million_tokens(2.0, 2000), 2) == 0.28


def test_a_13b_model_in_fp16_does_not_fit_a_24_gb_card():
    # Llama-2-13B: 13.0B parameters * 2 bytes = 26 GB > 24 GB
    plan = build_plan(PRESETS["llama-2-13b"], hardware_table()["rtx-4090"], Workload(context=1))
    assert close(plan.memory.weight_bytes, 26e9, 0.003)
    assert not plan.memory.fits and plan.memory.max_batch == 0 and plan.binding_wall == "capacity"
    assert plan.advice[0].wall == "capacity"  # the binding wall's advice comes first


def test_llama2_7b_kv_is_half_a_mebibyte_not_1_mb():
    # computed from its config: 2 (K and V) * 32 layers * 32 KV heads (MHA) * 128 head_dim * 2 bytes = 524,288 B
    # = 0.5 MiB per token; the widely copied "1 MB per token" is twice that.
    m = spec_from_hf_config({"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                             "model_type": "llama"}, "llama-2-7b")
    assert a.kv_bytes_per_token(m, "bf16") == 2 * 32 * 32 * 128 * 2 == 524_288 == 2**19
    assert m == dataclasses.replace(PRESETS["llama-2-7b"], source="config.json")


def test_prefill_flops_and_macs_for_qwen3_8b_at_40k_tokens():
    # linear: 2 FLOPs * 6.946B (attention + FFN) * 40,000 tokens = 555.7 TFLOP (+ the head for the last token);
    # attention: QK^T and PV over 40,000 * 40,001 / 2 causal pairs, 32 heads x (128 + 128), 36 layers:
    # 2 * 36 * 32 * 256 * 8.0e8 = 471.9 TFLOP. Total 1027.5 TFLOP = 513.8 T multiply-accumulates.
    f = a.prefill(PRESETS["qwen3-8b"], 40_000)
    assert close(f.linear_flops, 555.66e12, 0.001)
    assert close(f.attention_flops, 2 * 36 * 32 * 256 * 40_000 * 40_001 / 2, 1e-9)
    assert close(f.flops, 1027.5e12, 0.001)
    assert f.macs == f.flops / 2 and close(f.macs, 513.8e12, 0.001)
    # attention outgrows the linear layers where 2*36*32*256*T^2/2 = 2*6.946e9*T: T = 47,104 tokens
    assert close(a.attention_crossover(PRESETS["qwen3-8b"]), 47_104, 0.001)


def test_sliding_window_layers_cap_their_kv_at_the_window():
    # Gemma 3 270M: 18 layers, 15 local (window 512) + 3 global; 2 * 1 KV head * 256 * 2 bytes = 1,024 B per layer
    m = PRESETS["gemma3-270m"]
    assert m.local_layers == 15
    assert a.kv_bytes(m, "bf16", 10_000) == 1024 * (3 * 10_000 + 15 * 512)
    assert a.kv_bytes(m, "bf16", 100) == a.kv_bytes_per_token(m, "bf16") * 100


def test_llama_4_scout_is_108b_with_17b_active_and_its_chunked_layers_attend_within_their_chunk():
    """Llama-4-Scout: 16 experts of 8192 (one chosen) beside a shared one, 48 layers; 36 of them attend within
    8,192-token chunks: a prompt's query-key pairs and a decode step's keys counted chunk by chunk, against the
    definition summed position by position (a sliding window's would count a whole window for every query past it)."""
    m = PRESETS["llama-4-scout"]
    assert close(a.count_parameters(m).stored, 108e9, 0.01) and close(a.count_parameters(m).active, 17e9, 0.02)
    assert m.local_layers == 36 and m.chunked_window
    chunk = m.sliding_window
    qk, v = m.head_dim, m.head_dim

    def local_pairs(tokens: int) -> int:  # each position p sees p % chunk + 1 keys
        return sum(p % chunk + 1 for p in range(tokens))

    for tokens in (100, chunk, chunk + 1, 3 * chunk + 17):
        attention = a.prefill(m, tokens).attention_flops
        pairs = 12 * tokens * (tokens + 1) / 2 + 36 * local_pairs(tokens)
        assert close(attention, 2.0 * m.num_heads * (qk + v) * pairs, 1e-9)
    at = {context: a.decode_step_flops(m, 1, context) for context in (chunk, chunk + 1, 2 * chunk)}
    per_key = 2.0 * m.num_heads * (qk + v)
    assert close(at[chunk] - at[chunk + 1], per_key * (36 * (chunk - 1) - 12), 1e-9)  # a new chunk: one key
    assert at[2 * chunk] == at[chunk] + per_key * 12 * chunk
    # a decode reads its chunk's keys on those layers (held: up to a whole chunk, the bound kv_bytes gives)
    per_layer = a.kv_bytes_per_token(m, "bf16") / 48
    assert a.kv_read_bytes(m, "bf16", chunk + 1) == per_layer * (12 * (chunk + 1) + 36 * 1)
    assert a.kv_bytes(m, "bf16", chunk + 1) == per_layer * (12 * (chunk + 1) + 36 * chunk)
    assert a.kv_read_bytes(m, "bf16", chunk) == a.kv_bytes(m, "bf16", chunk)


def test_mamba2_2_7b_has_2_7b_parameters_and_a_172_mb_state_at_any_context():
    # 64 layers of a Mamba-2 mixer, 2560 wide, inner 5120 in 80 heads of 64, a 128-state, 1 group, 4 taps:
    # in_proj 2560 x (5120 + 5376 + 80), out_proj 5120 x 2560, conv 5376 x 5: ~40.2M a layer; tied embeddings
    m = PRESETS["mamba2-2.7b"]
    assert close(a.count_parameters(m).stored, 2.7e9, 0.01)
    # a state per layer: 5376 channels x 3 inputs + 80 x 64 x 128, in float32; no KV at all
    assert a.state_bytes(m) == 4 * 64 * (5376 * 3 + 80 * 64 * 128)
    assert a.kv_bytes(m, "bf16", 1_000_000) == 0
    assert a.sequence_cache_bytes(m, "bf16", 1) == a.sequence_cache_bytes(m, "bf16", 1_000_000)


def test_bamba_9b_is_9_78b_and_its_3_attention_layers_alone_grow_with_the_context():
    m = PRESETS["bamba-9b"]
    assert m.num_attention_layers == 3 and len(m.ssm_layers) == 29
    assert close(a.count_parameters(m).stored, 9.78e9, 0.005)  # the published 9.78B
    assert a.kv_bytes_per_token(m, "bf16") == 2 * 3 * 8 * 128 * 2  # K and V, 3 layers, 8 KV heads of 128
    assert a.sequence_cache_bytes(m, "bf16", 4096) == a.kv_bytes(m, "bf16", 4096) + a.state_bytes(m)


def test_moe_decode_reads_only_the_experts_the_batch_routes_to():
    m = PRESETS["qwen3-30b-a3b"]
    assert a.experts_touched(m, 1) == 8
    one, many = a.decode_weight_bytes(m, "bf16", 1), a.decode_weight_bytes(m, "bf16", 4096)
    assert close(one, 2 * (a.count_parameters(m).active - a.count_parameters(m).embeddings), 0.001)
    assert close(many, a.weight_bytes(m, "bf16") - 2 * a.count_parameters(m).embeddings, 0.001)


def test_smollm2_preset_matches_its_gguf_header(smollm2_path):
    header = spec_from_gguf(read_gguf(smollm2_path), smollm2_path.stem, f"GGUF header of {smollm2_path.name}")
    preset = PRESETS["smollm2"]
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "tie_word_embeddings")
    assert {f: getattr(header, f) for f in fields} == {f: getattr(preset, f) for f in fields}
    assert resolve_model(str(smollm2_path)) == header


def test_overrides_change_one_field_and_reject_unknown_ones():
    m = override(PRESETS["qwen3-8b"], ["num_kv_heads=4", "tie_word_embeddings=true"])
    assert m.num_kv_heads == 4 and m.tie_word_embeddings and a.kv_bytes_per_token(m, "bf16") == 147_456 / 2
    hw = override(H100, ["bandwidth_gb_s=2000"])
    assert isinstance(hw, HardwareSpec) and hw.ridge_point("bf16") == pytest.approx(989.4e12 / 2e12)
    with pytest.raises(ValueError, match="num_kv_heads"):
        override(PRESETS["qwen3-8b"], ["num_kv_heads=5"])  # does not divide 32 heads
    with pytest.raises(ValueError, match="field one of"):
        override(PRESETS["qwen3-8b"], ["layers=3"])
    faster = override(H100, ["tflops.bf16=1979", "tflops.fp4=4000"])
    assert faster.ridge_point("bf16") == pytest.approx(2 * H100.ridge_point("bf16"), rel=1e-3)
    assert faster.tflops["fp4"] == 4000 and H100.tflops["bf16"] == 989.4  # the table itself is untouched


def test_tpot_target_sizes_the_prefill_chunk_and_throughput_prices_the_tokens():
    # Qwen3-8B, 8,192-token prompt on H100: prefill is compute-bound at ~0.14 s; a 50 ms TPOT leaves
    # 50 ms - one decode step for prompt tokens at (prefill time / prompt tokens) each
    w = Workload(context=8192, tpot_target=0.05, price_per_hour=2, throughput=2000)
    plan = build_plan(PRESETS["qwen3-8b"], H100, w)
    chunked = [adv for adv in plan.advice if adv.technique == "chunked prefill"]
    per_token = plan.prefill.seconds / 8192
    chunk = int((0.05 - plan.decode.seconds) / per_token)
    assert len(chunked) == 1 and f"chunks of <= {chunk:,} tokens" in chunked[0].why
    assert plan.cost_per_million_tokens == pytest.approx(0.2778, rel=1e-3)  # priced at 2,000 tok/s, not the ceiling


def test_bad_input_names_the_field_and_lists_what_is_known():
    with pytest.raises(ValueError, match="qwen3-8b.*deepseek-v3"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="h100-sxm.*this-machine"):
        resolve_hardware("no-such-gpu")
    for bad, field in [({"context": -1}, "context"), ({"batch": 0}, "batch"), ({"gpus": 0}, "gpus"),
                       ({"dtype": "int3"}, "dtype"), ({"throughput": 0}, "throughput"),
                       ({"tpot_target": -1}, "TPOT"), ({"shared_prefix": 1.5}, "shared prefix")]:
        with pytest.raises(ValueError, match=field):
            Workload(**bad).validate()
    for accept in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"accept.*\[0, 1\)"):
            a.expected_tokens_per_pass(accept, 4)


def test_cli_plan_json_and_plot(tmp_path, capsys):
    png = tmp_path / "roofline.png"
    assert main(["plan", "--model", "qwen3-8b", "--hardware", "h100-sxm", "--context", "40000",
                 "--price-per-hour", "2", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["kv_bytes_per_token"] == 147_456
    assert out["decode"]["wall"] == "bandwidth" and out["prefill"]["wall"] == "compute"
    tokens_per_second = out["decode_tokens_per_second"]
    assert out["cost_per_million_tokens"] == pytest.approx(a.cost_per_million_tokens(2, tokens_per_second))
    assert out["advice"] and png.stat().st_size > 10_000
    assert main(["plan", "--model", "qwen3-8b", "--hardware", "h100-sxm"]) == 0
    text = capsys.readouterr().out
    assert "binding wall: bandwidth" in text and "MACs" in text  # the FLOP convention is printed


def test_cli_plan_spec_and_errors(capsys):
    assert main(["plan", "spec", "--accept", "0.8", "--k", "4", "--draft-cost", "0.05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expected_tokens_per_pass"] == pytest.approx(3.3616)
    assert main(["plan", "spec", "--accept", "1"]) == 2
    assert "outside [0, 1)" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3-8b", "--hardware", "h100-sxm", "--batch", "0"]) == 2
    assert "batch" in capsys.readouterr().err
    assert main(["plan", "--model", "nope", "--hardware", "h100-sxm"]) == 2
    assert "presets: qwen3-8b" in capsys.readouterr().err


def test_plan_on_this_machine_measures_it(capsys):
    assert main(["plan", "--model", "smollm2", "--hardware", "this-machine", "--context", "512", "--json"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["source"].startswith("measured here") and hw["bandwidth_gb_s"] > 0 and hw["tflops"]["bf16"] > 0


def test_plot_roofline_of_a_machine(tmp_path, capsys):
    png = tmp_path / "r.png"
    assert main(["plot", "roofline", "--hardware", "mi300x", "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_doctor_on_smollm2_reports_fractions_that_add_up(smollm2_path, tmp_path, capsys):
    png = tmp_path / "doctor.png"
    assert main(["doctor", "--model", "smollm2", "--output-len", "8", "--batch", "4", "--json",
                 "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    bandwidth = report["hardware"]["bandwidth_gb_s"] * 1e9
    names = [p["name"] for p in report["phases"]]
    assert names == ["prefill, batch 1", "decode, batch 1", "decode, batch 4", "prefill, batch 4"]
    for p in report["phases"]:
        assert p["bandwidth_fraction"] == pytest.approx(p["bytes"] / p["seconds"] / bandwidth)
        assert p["overhead_seconds"] == pytest.approx(p["seconds"] - p["bound_seconds"])
        assert p["bound_seconds"] >= p["bytes"] / bandwidth
    decode = report["phases"][1]
    assert report["predicted_decode_seconds"] == decode["bound_seconds"]
    assert report["measured_decode_seconds"] == decode["seconds"]
    b = report["breakdown"]
    assert b["matmul_seconds"] + b["other_seconds"] == pytest.approx(b["step_seconds"])
    assert report["binding_wall"] in ("bandwidth", "compute", "overhead") and report["recommendation"]
    assert png.stat().st_size > 10_000


def test_tensor_parallel_pays_for_161_all_reduces_of_a_token_s_activations_per_step():
    """Llama-3-70B over 2 H100s (NVLink 4: 450 GB/s, 5 us a ring step), batch 1, bf16: 80 layers x 2 + the
    embedding's = 161 all-reduces of 8192 x 2 bytes, each 2 x 5 us + 16,384 B / 450 GB/s; the logits' gather one
    latency + half of 128,256 x 4 bytes."""
    model, hw = resolve_model("llama-3-70b"), resolve_hardware("h100-sxm")
    plan = build_plan(model, hw, Workload(context=4096, gpus=2))
    tp = plan.tensor_parallel
    assert (tp.link, tp.allreduces_per_pass, tp.decode_bytes_per_allreduce) == ("nvlink4", 161, 16384)
    expected = 161 * (2 * 5e-6 + 16384 / 450e9) + 5e-6 + 128256 * 4 / 2 / 450e9
    assert tp.decode_communication_seconds == pytest.approx(expected)
    alone = build_plan(model, hw, Workload(context=4096)).decode.seconds
    assert plan.decode_tokens_per_second == pytest.approx(1 / (alone / 2 + expected))  # bytes split, comm added
    assert [s.gpus for s in tp.scaling] == [1, 2, 4, 8] and tp.scaling[0].communication_seconds == 0


def test_tensor_parallel_costs_more_over_pcie_and_stops_paying_where_latency_rules():
    """An 8B model at batch 1: each all-reduce is 8 kB, so link latency rules and 4 GPUs are slower than 2, over
    either link; PCIe's narrower link costs more at every size."""
    model = resolve_model("llama-3-8b")
    tp = {link: build_plan(model, resolve_hardware("h100-sxm"), Workload(gpus=2, link=link)).tensor_parallel
          for link in ("nvlink4", "pcie4-x16")}
    assert tp["nvlink4"].stops_paying_at == tp["pcie4-x16"].stops_paying_at == 4
    for nvlink, pcie in zip(tp["nvlink4"].scaling[1:], tp["pcie4-x16"].scaling[1:], strict=True):
        assert pcie.communication_seconds > nvlink.communication_seconds
        assert pcie.tokens_per_second < nvlink.tokens_per_second
    with pytest.raises(ValueError, match="link: apple-m4-max lists no interconnect between devices; name one of"):
        build_plan(model, resolve_hardware("apple-m4-max"), Workload(gpus=2))
    with pytest.raises(ValueError, match="link: 'smoke-signals' is not known"):
        build_plan(model, resolve_hardware("h100-sxm"), Workload(gpus=2, link="smoke-signals"))
    assert build_plan(model, resolve_hardware("h100-sxm"), Workload()).tensor_parallel is None


def test_a_second_bandwidth_probe_keeps_the_better_ceiling():
    """Benchmarks probe the read bandwidth before and after their runs and divide by the better of the two."""
    from ridge.plan.roofline import Roofline, remeasured

    slow = Roofline(read_gb_s=1e-3, matmul_gflop_s={"bfloat16": 5.0})
    probed = remeasured(slow)
    assert probed.read_gb_s > slow.read_gb_s and probed.matmul_gflop_s == slow.matmul_gflop_s
    fast = Roofline(read_gb_s=1e6, matmul_gflop_s={})
    assert remeasured(fast) == fast


def test_lfm2_s_published_sizes_and_its_small_state():
    """LFM2-1.2B's 1.17B parameters and LFM2-8B-A1B's 8.3B (1.5B active, as published, rounded); a short
    convolution's state is its last 2 gated inputs, 2048 wide, per layer: 160 KiB for 10 layers, whatever the
    context."""
    m = PRESETS["lfm2-1.2b"]
    assert close(a.count_parameters(m).stored, 1.17e9, 0.005)
    assert a.state_bytes(m) == 4 * 10 * 2048 * 2
    assert a.kv_bytes_per_token(m, "bf16") == 2 * 6 * 8 * 64 * 2  # K and V, 6 attention layers, 8 KV heads of 64
    moe = a.count_parameters(PRESETS["lfm2-8b-a1b"])
    assert close(moe.stored, 8.3e9, 0.01) and close(moe.active, 1.5e9, 0.05)


def test_qwen3_5_s_sizes_and_its_fixed_state():
    """Qwen3-Next-80B-A3B's 80B parameters (3B active without the embeddings, as published), Qwen3.5-35B-A3B's text
    model (35B with its vision tower) and Qwen3.5-9B's; a gated DeltaNet layer's state is each value head's
    128 x 128 matrix and the convolution's last 3 inputs of q, k and v, whatever the context, and only every
    fourth layer holds KV."""
    next_80b = a.count_parameters(PRESETS["qwen3-next-80b-a3b"])
    assert close(next_80b.stored, 80e9, 0.01) and close(next_80b.active - next_80b.embeddings - next_80b.output_head,
                                                        3e9, 0.1)
    assert close(a.count_parameters(PRESETS["qwen3.5-35b-a3b"]).stored, 34.7e9, 0.005)
    m = PRESETS["qwen3.5-9b"]
    assert close(a.count_parameters(m).stored, 8.95e9, 0.005)
    assert a.state_bytes(m) == 4 * 24 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128))
    assert a.kv_bytes_per_token(m, "bf16") == 2 * 8 * 4 * 256 * 2  # K and V, 8 attention layers, 4 KV heads of 256


def test_an_encoder_s_plan_is_a_pass_over_a_batch_of_prompts(capsys, tmp_path):
    """bge-base (BERT-base) on an H100: no decode and no KV; a pass's FLOPs are its linear layers' for every token and
    attention over every pair of each prompt's tokens (4 x layers x T^2 x hidden a prompt); the prompt is cut to the
    model's 512 positions; one prompt is launch-bound (batch more), 64 are compute-bound (8-bit matmuls)."""
    from ridge.plan.encoder import build_encoder_plan

    model, hw = resolve_model("bge-base-en-v1.5"), resolve_hardware("h100-sxm")
    one = build_encoder_plan(model, hw, Workload(batch=1))
    assert one.prompt_tokens == 512 and one.binding_wall == "overhead"
    counts = a.count_parameters(model)
    attention = 4 * model.num_layers * 512 * 512 * model.hidden_size
    assert one.attention_flops == pytest.approx(attention)
    assert one.embed.flops == pytest.approx(2 * counts.per_token_linear * 512 + attention)
    assert one.advice[0].technique == "batch more prompts a pass" and one.advice[0].gain > 1
    many = build_encoder_plan(model, hw, Workload(batch=64, prompt=256))
    assert many.binding_wall == "compute" and many.embed.flops == pytest.approx(64 * a.prefill(model, 256, True).flops)
    assert many.prompts_per_second == pytest.approx(64 / many.embed.seconds)
    assert many.advice[0].technique.startswith("8-bit") and many.advice[0].gain == pytest.approx(2.0, rel=1e-3)
    png = tmp_path / "encoder.png"
    assert main(["plan", "--model", "bge-base-en-v1.5", "--hardware", "h100-sxm", "--batch", "64", "--json",
                 "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["encoder"] and report["binding_wall"] == "compute" and "decode" not in report
    assert png.stat().st_size > 0
