"""llama, qwen2 and qwen3 on small random configs: ridge's logits and greedy tokens against HF transformers.

No real qwen3 weights can be had here, so every architecture is also built from a tiny random config,
saved as safetensors, and loaded by both sides from the same files.
"""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from conftest import assert_family_matches_hf, assert_same_logits, random_prompts
from ridge.kernels import cpu_ops
from ridge.kv.layout import Window

VOCAB = 320


def byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def with_drawn_norms(model):
    """HF starts norm weights at 1: every norm's drawn around it, so that a misplaced norm shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, 1.0, 0.3)
    return model


def saved(model, path):
    """An HF model saved with the byte-level tokenizer: (its folder, the model)."""
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def hf_config(arch: str, tie: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  initializer_range=0.2, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=100000.0)
    return Qwen3Config(**common, head_dim=24, rope_theta=1000000.0)  # head_dim != hidden / heads on purpose


@pytest.fixture(scope="module", params=[("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)],
                ids=["llama-tied", "llama", "qwen2", "qwen3"])
def random_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, tie = request.param
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, tie), dtype=torch.float32).eval()
    if arch == "qwen2":  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch == "qwen3":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.3)
            torch.nn.init.normal_(layer.self_attn.k_norm.weight, 1.0, 0.3)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


@pytest.mark.parametrize("backend", ["paged", "reference"])
def test_logits_match_hf(random_model, make_llm_for_test, backend):
    path, hf = random_model
    llm = make_llm_for_test(path, dtype="float32", attention_backend=backend)
    for ids in random_prompts(3, VOCAB, 5, 60, seed=1):
        ours = llm.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() < 1e-4 * max(scale, 1.0), "logits differ beyond float32 noise"


def test_greedy_tokens_match_hf(random_model, make_llm_for_test):
    from ridge import SamplingParams

    path, hf = random_model
    llm = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=16)  # chunked prefill on the way
    prompts = random_prompts(4, VOCAB, 5, 40, seed=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


@pytest.mark.slow  # 28 s: each kernel on each architecture
@pytest.mark.parametrize("args", [{"dtype": "float32"}, {"dtype": "float32", "quantization": "int4"},
                                  {"dtype": "float32", "quantization": "int8", "int8_activations": True},
                                  {"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "int4"},
                                  {"dtype": "bfloat16", "quantization": "int8"},
                                  pytest.param({"dtype": "bfloat16", "quantization": "int4", "int8_activations": True},
                                               marks=pytest.mark.skipif("avx512_vnni" not in cpu_ops.cpu_flags(),
                                                                        reason="bf16 int8 activations: AVX512-VNNI"))],
                         ids=["float32", "int4", "int8+a8", "bfloat16", "bfloat16-int4", "bfloat16-int8",
                              "bfloat16-int4+a8"])
def test_decode_stack_equals_the_python_path(random_model, make_llm_for_test, args):
    """Decode steps in one C++ call (kernels/decode_stack.py) against every step in Python: qwen2's biases,
    qwen3's per-head norms and head_dim, tied heads; in bfloat16 int4 on the exact bf16 dot-product kernel
    (torch's int4 layout where the CPU lacks AVX512-BF16, which changes kernel at TILED_MIN_ROWS rows), int8 per
    channel on ridge's kernel, dense layers (oneDNN-packed where the CPU has bf16 arithmetic) and the integer
    matrix kernel; the same tokens and log-probabilities to the last bit."""
    from ridge import SamplingParams
    from ridge.kernels.decode_stack import MAX_ROWS
    from ridge.linear import Int4Linear
    from ridge.linear.rows import TILED_MIN_ROWS

    path, _ = random_model
    stacked = make_llm_for_test(path, **args)
    eager = make_llm_for_test(path, enforce_eager=True, **args)
    assert stacked.engine.runner.decode_stack is not None
    int4 = any(isinstance(m, Int4Linear) for m in stacked.engine.loaded.model.modules())
    assert stacked.engine.runner.decode_stack.max_rows == (TILED_MIN_ROWS - 1 if int4 else MAX_ROWS)
    prompts = random_prompts(4, VOCAB, 5, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


# ---- Granite: llama with scalars on the embeddings, the residual branches, the scores and the logits ----------
@pytest.fixture(scope="module")
def random_granite(tmp_path_factory):
    """A tiny random Granite with Granite 3's scalars (embeddings x12, branches x0.22, logits / 8), its score scale
    not the head width's, and tied embeddings."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1,
                           eos_token_id=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                           attention_multiplier=0.1, logits_scaling=8.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("granite")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_granite_matches_hf(random_granite, make_llm_for_test, caplog):
    """Logits within float32 noise of HF's, and greedy tokens HF's choices in a batch of 16 with chunked prefill,
    decode steps in the fused C++ stack (its branches scaled by the residual multiplier)."""
    from conftest import assert_logits_match_hf, greedy_batch_checked_against_hf

    path, hf = random_granite
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)
    llm, *_ = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    cfg = llm.engine.loaded.config
    assert (cfg.architecture, cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == ("granite", 12.0, 0.22, 0.1, 8.0)
    if cpu_ops.load() is not None:
        assert llm.engine.runner.decode_stack is not None and "fused decode step has no" not in caplog.text


def test_granite_s_scalars_are_refused_on_another_architecture(tmp_path):
    """A llama config carrying Granite's scalars: refused by name, not run as a plain llama."""
    import json

    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 96, "residual_multiplier": 0.22}
    with pytest.raises(ValueError, match="residual_multiplier: Granite's scalars on architecture 'llama'"):
        config_from_spec(spec_from_hf_config(json.loads(json.dumps(config)), "llama"))


def test_a_random_granite_written_as_gguf_reads_back_as_the_same_model(random_granite, smollm2_path, tmp_path,
                                                                        make_llm_for_test):
    """Granite under llama.cpp's names and header (granite.embedding_scale, residual_scale, logit_scale,
    attention.scale; q and k rows permuted as llama's: its converter's GraniteModel is a LlamaModel) loads from the
    file as the model ridge draws for the config: the same scalars and logits."""
    import dataclasses
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_granite[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert ours.architecture == "granite" and ours.residual_multiplier == pytest.approx(0.22)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps, residual_multiplier=theirs.residual_multiplier,
                               attention_multiplier=theirs.attention_multiplier) == theirs  # float32 in GGUF
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-4)


def test_llama_with_attention_bias_matches_hf(tmp_path, make_llm_for_test):
    """HF llama's attention_bias: biases on q / k / v and on o_proj, all drawn (HF initialises them to zero)."""
    from transformers import AutoModelForCausalLM

    from conftest import assert_logits_match_hf

    torch.manual_seed(0)
    config = hf_config("llama", False)
    config.attention_bias = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for attn in (layer.self_attn for layer in model.model.layers):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert_logits_match_hf(make_llm_for_test, tmp_path, model, VOCAB)


# ---- SmolLM3: llama with every fourth layer's attention unturned (NoPE) ------------------------------------------
@pytest.fixture(scope="module")
def random_smollm3(tmp_path_factory):
    """A tiny random SmolLM3 of 4 layers (the last without rotary, its config's no_rope_layers) with attention
    biases on q / k / v and o_proj, all drawn."""
    from transformers import AutoModelForCausalLM, SmolLM3Config

    torch.manual_seed(0)
    config = SmolLM3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, attention_bias=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for attn in (layer.self_attn for layer in model.model.layers):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp("smollm3")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_smollm3_matches_hf_with_its_nope_layers(random_smollm3, make_llm_for_test):
    """Its NoPE layer reads q and k unturned: HF's logits and greedy tokens, and the fused decode step's tokens and
    log-probabilities equal the Python path's (the layer's rotary table zero dims wide there)."""

    path, hf = random_smollm3
    assert make_llm_for_test(path, dtype="float32").engine.loaded.config.nope_layers == (3,)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB, longest=40)


def test_a_random_smollm3_written_as_gguf_reads_back_as_the_same_model(random_smollm3, smollm2_path, tmp_path,
                                                                        make_llm_for_test):
    """SmolLM3 under llama.cpp's smollm3 (llama's names and permuted q / k rows; the NoPE layers every fourth, which
    the file does not say: llama.cpp's graph fixes them) loads as the model ridge draws; another NoPE pattern is
    refused by the writer, not written as a file llama.cpp would run otherwise."""
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_smollm3[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert from_file.engine.loaded.config.nope_layers == (3,)
    assert_same_logits(from_file, drawn, tokens=20)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="NoPE layers"):
        gguf_round_trip({**config, "no_rope_layers": [1, 0, 1, 1]}, other, smollm2_path, make_llm_for_test)


# ---- Seed-OSS: llama with q / k / v biases, o_proj's as its config says -------------------------------------------
@pytest.mark.parametrize("out_bias", [False, True], ids=["seed-oss", "o_proj-bias"])
def test_seed_oss_matches_hf_and_reads_back_from_gguf(out_bias, tmp_path, smollm2_path, make_llm_for_test):
    """Seed-OSS's attention_out_bias (False in its checkpoints) decides o_proj's bias apart from q / k / v's: HF's
    logits either way, and its GGUF (llama.cpp's seed_oss, the bias's presence in the file) reads back the same."""
    import json

    from transformers import AutoModelForCausalLM, SeedOssConfig

    from conftest import assert_logits_match_hf, gguf_round_trip

    torch.manual_seed(0)
    config = SeedOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           rms_norm_eps=1e-6, initializer_range=0.2, pad_token_id=0, attention_out_bias=out_bias)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for attn in (layer.self_attn for layer in model.model.layers):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path / "hf")
    byte_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    llm = make_llm_for_test(tmp_path / "hf", dtype="float32")
    assert llm.engine.loaded.config.attention_out_bias == out_bias
    assert_logits_match_hf(make_llm_for_test, tmp_path / "hf", model, VOCAB)
    hf_config = {**json.loads((tmp_path / "hf" / "config.json").read_text()), "vocab_size": 49152}
    (tmp_path / "gguf").mkdir()
    from_file, drawn = gguf_round_trip(hf_config, tmp_path / "gguf", smollm2_path, make_llm_for_test)
    assert from_file.engine.loaded.config.attention_out_bias == out_bias
    assert_same_logits(from_file, drawn, tokens=20)


# ---- Phi-3 / Phi-4: q / k / v and gate / up stored fused, LongRoPE, three quarters of each head rotary ---------
PHI3_ORIGINAL = 32  # the "pretraining" context of LongRoPE's short factors


@pytest.fixture(scope="module")
def random_phi3(tmp_path_factory):
    """A tiny random Phi-4-mini-like model: LongRoPE over 128 positions from an original 32, rotary on 12 of each
    head's 16 dims, and Phi-3-mini-4k's sliding window on every layer (48 tokens here)."""
    from transformers import AutoModelForCausalLM, Phi3Config

    torch.manual_seed(0)
    pairs = 6
    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * PHI3_ORIGINAL,
                        original_max_position_embeddings=PHI3_ORIGINAL, partial_rotary_factor=0.75,
                        sliding_window=48, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(pairs)],
                                      "long_factor": [3.0 + 4.0 * i for i in range(pairs)]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_phi3_matches_hf_with_either_longrope_factor_set(random_phi3, make_llm_for_test):
    """Serving no more than the original context, the short factors (HF's for such a sequence); serving more, the
    long ones for every position (HF's for a sequence past the original, vLLM's choice by max_model_len): HF's
    logits either way, and the two sets differ (the check can fail); greedy tokens of a batch equal HF's, and the
    fused decode step equals the Python path."""
    path, hf = random_phi3
    short = make_llm_for_test(path, dtype="float32", max_model_len=PHI3_ORIGINAL)
    long = make_llm_for_test(path, dtype="float32")
    assert not short.engine.loaded.config.rope_scaling.use_long_factor
    assert long.engine.loaded.config.rope_scaling.use_long_factor and long.engine.loaded.config.sliding_window == 48
    for llm, (low, high) in ((short, (5, PHI3_ORIGINAL - 1)), (long, (PHI3_ORIGINAL + 1, 110))):
        for ids in random_prompts(3, VOCAB, low, high, seed=1):
            with torch.inference_mode():
                ref = hf(torch.tensor([ids])).logits[0]
            assert (llm.engine.prompt_logits(ids) - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1)
    ids = random_prompts(1, VOCAB, 20, 21, seed=3)[0]
    assert not torch.allclose(short.engine.prompt_logits(ids), long.engine.prompt_logits(ids), atol=1e-3)
    # the greedy batch's sequences run past the original context: the long set, HF's for them too
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB, logits=False)


def test_a_random_phi3_written_as_gguf_reads_back_as_the_same_model(random_phi3, smollm2_path, tmp_path,
                                                                     make_llm_for_test):
    """Phi-3 under llama.cpp's phi3 (attn_qkv fused, ffn_up holding gate and up, the LongRoPE factors as the
    rope_factors_long / _short tensors and its attention factor a key) loads as the model ridge draws."""
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_phi3[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert ours.rope_scaling.use_long_factor and ours.rotary_dim == theirs.rotary_dim == 12
    assert ours.sliding_window == theirs.sliding_window == 48
    assert torch.allclose(from_file.engine.loaded.model.rotary.freqs, drawn.engine.loaded.model.rotary.freqs, atol=1e-6)
    assert_same_logits(from_file, drawn)


# ---- OLMo-2 / OLMo-3: no pre-norms, each sublayer's output normed; OLMo-3's windows with unscaled rotary ---------
@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def random_olmo(request, tmp_path_factory):
    """A tiny random OLMo-2 (4 layers), or OLMo-3 (3 of 4 layers windowed at 24 tokens, YaRN on the global layer
    only), every norm's weight drawn."""
    from transformers import AutoModelForCausalLM, Olmo2Config, Olmo3Config

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Olmo2Config(**common) if request.param == "olmo2" else Olmo3Config(
        **common, sliding_window=24,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return saved(with_drawn_norms(model), tmp_path_factory.mktemp(request.param))


def test_olmo_matches_hf_without_pre_norms(random_olmo, make_llm_for_test):
    """Each layer reads the residual stream itself and norms its attention's and MLP's outputs (q and k normed over
    all heads): HF's logits and greedy tokens, and the fused decode step (a layer with no input norms there) equals
    the Python path. OLMo-3's windowed layers turn an unscaled rotary beside the global layer's YaRN."""

    path, hf = random_olmo
    llm = make_llm_for_test(path, dtype="float32")
    model = llm.engine.loaded.model
    assert all(not hasattr(layer.input_norm, "weight") for layer in model.layers)
    if model.cfg.architecture == "olmo3":
        assert [model.cfg.layer_window(i) for i in range(4)] == [Window(24)] * 3 + [None]
        assert not torch.allclose(model.rotary_local.freqs, model.rotary.freqs)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)
    with pytest.raises(ValueError, match="awq does not support layers without input norms"):
        make_llm_for_test(path, dtype="float32", quantization="awq", calibration_windows=1)


def test_a_random_olmo_written_as_gguf_reads_back_as_the_same_model(random_olmo, smollm2_path, tmp_path,
                                                                     make_llm_for_test):
    """OLMo-2 and OLMo-3 under llama.cpp's olmo2 (Gemma's post-norm names; OLMo-3's window, its pattern and the
    windowed layers' unscaled base as header keys) load as the model ridge draws."""
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_olmo[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert (ours.sliding_window, ours.global_every, ours.rope_local_theta, ours.pre_norms) == (
        theirs.sliding_window, theirs.global_every, theirs.rope_local_theta, False)
    assert_same_logits(from_file, drawn)


# ---- EXAONE 4: OLMo-2's norms with per-head q / k norms; windows on 3 of 4 layers, the global ones without rotary --
def exaone4_config(windowed: bool, vocab: int = VOCAB):
    from transformers import Exaone4Config

    layers = 4
    return Exaone4Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=not windowed,
        sliding_window=24 if windowed else None, sliding_window_pattern=4 if windowed else None,
        layer_types=None if windowed else ["full_attention"] * layers,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})


@pytest.fixture(scope="module")
def random_exaone4(tmp_path_factory):
    """A tiny random EXAONE 4 of the 32B's kind: 3 of 4 layers windowed (24 tokens), the global one turning no
    rotary, Llama 3.1's scaled rotary elsewhere, every norm's weight drawn."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(exaone4_config(windowed=True), dtype=torch.float32).eval()
    return saved(with_drawn_norms(model), tmp_path_factory.mktemp("exaone4"))


def test_exaone4_matches_hf_with_its_rotary_free_global_layers(random_exaone4, make_llm_for_test):
    """HF's logits and greedy tokens past the window and the original context, and the fused decode step equals the
    Python path."""

    path, hf = random_exaone4
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    assert cfg.nope_layers == (3,) and [cfg.layer_window(i) for i in range(4)] == [Window(24)] * 3 + [None]
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)


def test_a_random_exaone4_written_as_gguf_reads_back_as_the_same_model(smollm2_path, tmp_path, make_llm_for_test):
    """EXAONE-4.0-1.2B's kind (no windows, the head tied) under llama.cpp's exaone4 loads as the model ridge draws;
    a windowed shape other than the 32B's, which llama.cpp would run unwindowed, is refused by the writer."""
    from conftest import gguf_round_trip

    from_file, drawn = gguf_round_trip(exaone4_config(windowed=False, vocab=49152).to_dict(), tmp_path, smollm2_path,
                                       make_llm_for_test)
    assert from_file.engine.loaded.config.pre_norms is False and from_file.engine.loaded.config.nope_layers == ()
    assert_same_logits(from_file, drawn)
    windowed = tmp_path / "windowed"
    windowed.mkdir()
    with pytest.raises(ValueError, match="llama.cpp's exaone4 windows EXAONE-4.0-32B's shape only"):
        gguf_round_trip(exaone4_config(windowed=True, vocab=49152).to_dict(), windowed, smollm2_path, make_llm_for_test)


# ---- GLM-4 (0414): pre-norms and sandwich norms, q / k / v biases, half of each head rotary in interleaved pairs --
@pytest.fixture(scope="module")
def random_glm4(tmp_path_factory):
    """A tiny random GLM-4: its four norms a layer (their weights drawn), q / k / v biases drawn, rotary on 8 of
    each head's 16 dims in interleaved pairs (the rows reordered to halves at load)."""
    from transformers import AutoModelForCausalLM, Glm4Config

    torch.manual_seed(0)
    config = Glm4Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        attention_bias=True, partial_rotary_factor=0.5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return saved(with_drawn_norms(model), tmp_path_factory.mktemp("glm4"))


def test_glm4_matches_hf_with_its_interleaved_rotary(random_glm4, make_llm_for_test):
    """HF's logits and greedy tokens, and the fused decode step equals the Python path."""

    path, hf = random_glm4
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    assert (cfg.rotary_dim, cfg.qkv_bias, cfg.attention_out_bias, cfg.sandwich_norms) == (8, True, False, True)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)


def test_a_random_glm4_written_as_gguf_reads_back_as_the_same_model(random_glm4, smollm2_path, tmp_path,
                                                                     make_llm_for_test):
    """GLM-4 under llama.cpp's glm4 (q / k rows in their interleaved pairs, as its converter leaves them; ffn_up
    holding gate and up; the sandwich norms under Gemma's names) loads as the model ridge draws."""
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_glm4[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert from_file.engine.loaded.config.rotary_dim == 8 and from_file.engine.loaded.config.qkv_bias
    assert_same_logits(from_file, drawn)


# ---- Qwen2.5-VL / Qwen3-VL: their language models, for text ----------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_checkpoint_serves_its_language_model(name, tmp_path, make_llm_for_test):
    """A multimodal Qwen's checkpoint (its vision tower beside the language model, Qwen3-VL's under
    model.language_model): HF's logits on text, whose three equal positions turn the multimodal rotary as one plain
    rotary. The vision tower loads with it (images: tests/test_vision.py)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3VLConfig

    from conftest import assert_logits_match_hf

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64,
              "deepstack_visual_indexes": [0]}  # (Qwen2.5-VL's tower has none: ignored)
    if name == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                                  vision_config=vision)
    else:
        config = Qwen3VLConfig(text_config={**text, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                     "mrope_interleaved": True}},
                               vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    llm = make_llm_for_test(tmp_path, dtype="float32")
    assert llm.engine.loaded.config.architecture == ("qwen2" if name == "qwen2_5_vl" else "qwen3")
    assert any("visual" in key for key in llm.engine.loaded.model.state_dict())
    assert_logits_match_hf(make_llm_for_test, tmp_path, model, VOCAB)


# ---- Ernie 4.5: llama with every head's rotary in interleaved pairs (its mixture: tests/test_moe.py) -------------
def test_ernie4_5_matches_hf_and_reads_back_from_gguf(tmp_path, smollm2_path, make_llm_for_test):
    """Ernie 4.5's dense model (ERNIE-4.5-0.3B's kind: the head tied): HF's logits and greedy tokens, the fused step
    equal to the Python path, and its GGUF (llama.cpp's ernie4_5, q / k rows in their pairs) read back the same;
    the layouts ridge does not run are refused by name."""
    import json

    from transformers import AutoModelForCausalLM, Ernie4_5Config

    from conftest import gguf_round_trip
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    torch.manual_seed(0)
    config = Ernie4_5Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "hf"
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    assert make_llm_for_test(path, dtype="float32").engine.loaded.config.rope_interleave
    assert_family_matches_hf(make_llm_for_test, path, model, VOCAB, dtypes=("bfloat16",))
    hf_config = {**json.loads((path / "config.json").read_text()), "vocab_size": 49152}
    (tmp_path / "gguf").mkdir()
    from_file, drawn = gguf_round_trip(hf_config, tmp_path / "gguf", smollm2_path, make_llm_for_test)
    assert_same_logits(from_file, drawn, tokens=20)
    for change, message in (({"use_bias": True}, "use_bias: biases on Ernie 4.5's projections"),
                            ({"model_type": "ernie4_5_moe", "moe_num_experts": 8, "moe_k": 2,
                              "moe_layer_interval": 2}, "moe_layer_interval / moe_layer_end_index"),
                            ({"model_type": "ernie4_5_moe", "moe_num_experts": 8, "moe_k": 2, "moe_norm_min": 0.5},
                             "moe_norm_min: a floor of 0.5")):
        with pytest.raises(ValueError, match=message):
            config_from_spec(spec_from_hf_config({**hf_config, **change}, "ernie"))


# ---- Command R / R7B / A: LayerNorm, attention and the MLP side by side, interleaved rotary, scaled logits -------
@pytest.fixture(scope="module", params=["cohere", "cohere2"])
def random_cohere(request, tmp_path_factory):
    """A tiny random Command R (cohere), or Command R7B's kind (cohere2: windows of 24 on 3 of 4 layers, the global
    one turning no rotary), logits scaled by 0.25, every norm's weight drawn."""
    from transformers import AutoModelForCausalLM, Cohere2Config, CohereConfig

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, layer_norm_eps=1e-5, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_scale=0.25)
    config = CohereConfig(**common) if request.param == "cohere" else Cohere2Config(
        **common, sliding_window=24, sliding_window_pattern=4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return saved(with_drawn_norms(model), tmp_path_factory.mktemp(request.param))


def test_cohere_matches_hf_with_its_parallel_blocks(random_cohere, make_llm_for_test):
    """Each layer's attention and MLP read one LayerNorm's output and join the residual together: HF's logits and
    greedy tokens, and the fused decode step (LayerNorm and parallel layers there) equals the Python path."""

    path, hf = random_cohere
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    assert (cfg.norm_kind, cfg.parallel_block, cfg.logits_scaling) == ("layer", True, 4.0)
    if cfg.architecture == "cohere2":
        assert cfg.nope_layers == (3,) and [cfg.layer_window(i) for i in range(4)] == [Window(24)] * 3 + [None]
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)


def test_command_r_plus_s_per_head_q_k_layernorms_match_hf(tmp_path, make_llm_for_test):
    """Command R+ (use_qk_norm): a LayerNorm over each head of q and of k before the rotary, each head its own
    weight: HF's logits and greedy tokens, the fused decode step equal to the Python path, the same tokens over two
    tensor-parallel ranks (each holding its heads' weights); its GGUF form is refused by name, not written."""
    from transformers import AutoModelForCausalLM, CohereConfig

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    torch.manual_seed(0)
    config = CohereConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          layer_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          logit_scale=0.25, use_qk_norm=True)
    path, hf = saved(with_drawn_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()), tmp_path)
    llm = make_llm_for_test(path, dtype="float32")
    attn = llm.engine.loaded.model.layers[0].attn
    assert attn.q_norm.weight.shape == (4, 16) and attn.k_norm.weight.shape == (2, 16)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)
    assert_two_ranks_give_one_process_s_tokens(make_llm_for_test, llm, path)
    with pytest.raises(ValueError, match="use_qk_norm"):
        write_random_gguf(random_spec(f"random:{path}"), tmp_path / "model.gguf", path, float16=False)


def assert_two_ranks_give_one_process_s_tokens(make_llm_for_test, llm, path) -> None:
    """`llm`'s greedy tokens for three prompts, and those of the same model over two tensor-parallel ranks: equal."""
    from ridge import SamplingParams

    prompts = random_prompts(3, VOCAB, 5, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tp = make_llm_for_test(path, dtype="float32", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == one
    tp.engine.close()


def test_a_random_cohere_written_as_gguf_reads_back_as_the_same_model(random_cohere, smollm2_path, tmp_path,
                                                                       make_llm_for_test):
    """Command R under llama.cpp's command-r, R7B's kind under its cohere2 (the windows' pattern and the rotary-free
    global layers fixed by llama.cpp, not in the file): LayerNorm's epsilon and the logits' scale as header keys, q /
    k rows in their pairs; the file loads as the model ridge draws."""
    import json

    from conftest import gguf_round_trip

    config = {**json.loads((random_cohere[0] / "config.json").read_text()), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert (ours.logits_scaling, ours.nope_layers, ours.sliding_window) == (
        theirs.logits_scaling, theirs.nope_layers, theirs.sliding_window)
    assert_same_logits(from_file, drawn)


@pytest.fixture(scope="module")
def random_starcoder2(tmp_path_factory):
    """A tiny random StarCoder2: biases on q, k, v, o, the MLP's c_fc and c_proj and every LayerNorm (all drawn, as
    the norms' weights are), its ungated GELU-tanh MLP, windows of 24 over prompts of up to 100 tokens."""
    from transformers import AutoModelForCausalLM, Starcoder2Config

    torch.manual_seed(0)
    config = Starcoder2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              norm_epsilon=1e-5, initializer_range=0.2, sliding_window=24, use_bias=True,
                              bos_token_id=1, eos_token_id=2)
    model = with_drawn_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(param, 0.0, 0.3)
    return saved(model, tmp_path_factory.mktemp("starcoder2"))


def test_starcoder2_matches_hf(random_starcoder2, make_llm_for_test):
    """LayerNorms with biases, biased projections, an ungated MLP and sliding windows: HF's logits and greedy tokens,
    and the fused decode step (the three there too) equal to the Python path; two tensor-parallel ranks (the MLP's
    up rows cut alone, not as a gate's and an up's) give one process's tokens."""
    path, hf = random_starcoder2
    llm = make_llm_for_test(path, dtype="float32")
    cfg = llm.engine.loaded.config
    assert (cfg.norm_kind, cfg.norm_bias, cfg.gated_mlp, cfg.mlp_bias, cfg.attention_out_bias, cfg.sliding_window) == (
        "layer", True, False, True, True, 24)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)
    assert_two_ranks_give_one_process_s_tokens(make_llm_for_test, llm, path)


def test_a_random_starcoder2_written_as_gguf_reads_back_as_the_same_model(random_starcoder2, smollm2_path, tmp_path,
                                                                           make_llm_for_test, caplog):
    """StarCoder2 under llama.cpp's starcoder2: its LayerNorms' biases and epsilon, the ungated MLP's ffn_up alone,
    the biases of every projection; the file loads as the model ridge draws. A window, which llama.cpp's starcoder2
    does not run and a GGUF cannot say, is refused by name rather than dropped by the writer, and loading a file whose
    context passes the checkpoints' window says that it attends unwindowed."""
    import json

    from conftest import gguf_round_trip
    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    config = {**json.loads((random_starcoder2[0] / "config.json").read_text()), "vocab_size": 49152,
              "sliding_window": None, "max_position_embeddings": 8192}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert "starcoder2 GGUF names no sliding window" in caplog.text
    fields = ("norm_bias", "gated_mlp", "mlp_bias", "attention_out_bias", "rms_norm_eps", "sliding_window")
    ours, theirs = (tuple(getattr(llm.engine.loaded.config, f) for f in fields) for llm in (from_file, drawn))
    assert ours == pytest.approx(theirs) == (True, False, True, True, 1e-5, 0)  # the file's epsilon: a float32
    assert_same_logits(from_file, drawn)
    with pytest.raises(ValueError, match="sliding_window=0"):
        write_random_gguf(random_spec(f"random:{random_starcoder2[0]}"), tmp_path / "windowed.gguf", smollm2_path,
                          float16=False)


def test_qwen3_vl_moe_reads_its_stacked_experts_in_either_layout(tmp_path, make_llm_for_test):
    """Qwen3-VL-MoE's language model: its experts stacked one tensor per projection, as HF transformers saves them
    ([experts, out, in]) and as the published checkpoints hold them ([experts, in, out]): HF's logits from both, the
    router renormalising its top k as HF's always does."""
    import glob

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig

    from conftest import assert_logits_match_hf

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.2, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64,
              "deepstack_visual_indexes": [0]}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(Qwen3VLMoeConfig(text_config=text, vision_config=vision),
                                                    dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    cfg = make_llm_for_test(tmp_path, dtype="float32").engine.loaded.config
    assert (cfg.architecture, cfg.num_experts, cfg.norm_topk_prob) == ("qwen3_moe", 8, True)
    assert_logits_match_hf(make_llm_for_test, tmp_path, model, VOCAB)
    (weights,) = glob.glob(str(tmp_path / "*.safetensors"))
    published = {name: tensor.transpose(1, 2).contiguous() if ".mlp.experts." in name else tensor
                 for name, tensor in load_file(weights).items()}
    save_file(published, weights, metadata={"format": "pt"})
    assert_logits_match_hf(make_llm_for_test, tmp_path, model, VOCAB)


# ---- Ministral 3: llama with YaRN, its queries sharpened past the original context --------------------------------
MINISTRAL3_ORIGINAL = 16  # the temperature's period here: 1 + beta * ln(1 + floor(position / 16))


@pytest.fixture(scope="module")
def random_ministral3(tmp_path_factory):
    """A tiny random Ministral 3, as its vision model wraps it (Mistral3ForConditionalGeneration): YaRN 4x over an
    original 16 positions, and a temperature of beta 0.5 (the real models' 0.1 over 16,384), so that prompts of a
    few dozen tokens cross several of its steps."""
    from transformers import AutoModelForImageTextToText, Mistral3Config

    text = dict(model_type="ministral3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": MINISTRAL3_ORIGINAL, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "max_position_embeddings": 512,
                                 "llama_4_scaling_beta": 0.5})
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 16}
    torch.manual_seed(0)
    model = with_drawn_norms(AutoModelForImageTextToText.from_config(
        Mistral3Config(text_config=text, vision_config=vision), dtype=torch.float32).eval())
    return saved(model, tmp_path_factory.mktemp("ministral3"))


def test_ministral3_matches_hf_with_its_attention_temperature(random_ministral3, make_llm_for_test):
    """Ministral 3 (the language model of its vision checkpoint): HF's logits over prompts of up to 80 tokens (five
    temperature steps), greedy tokens of a batch, and the fused decode step equal to the Python path; HF without the
    temperature gives other logits (the check can fail)."""
    from ridge.rope_scaling import AttentionTemperature

    path, hf = random_ministral3
    llm = make_llm_for_test(path, dtype="float32")
    cfg = llm.engine.loaded.config
    assert cfg.architecture == "ministral3" and cfg.rope_scaling.kind == "yarn"
    assert cfg.attention_temperature == AttentionTemperature(scale=0.5, length=MINISTRAL3_ORIGINAL)
    assert_family_matches_hf(make_llm_for_test, path, hf, VOCAB)
    ids = random_prompts(1, VOCAB, 60, 61, seed=2)[0]
    with torch.inference_mode():
        hf.config.text_config.rope_parameters["llama_4_scaling_beta"] = 0.0
        try:
            untempered = hf(torch.tensor([ids])).logits[0]
        finally:
            hf.config.text_config.rope_parameters["llama_4_scaling_beta"] = 0.5
        tempered = hf(torch.tensor([ids])).logits[0]
    ours = llm.engine.prompt_logits(ids)
    assert (ours - tempered).abs().max() < 1e-4 * tempered.abs().max() < (ours - untempered).abs().max()
    # within the first period every query's factor is 1: the two agree there
    assert torch.allclose(untempered[:MINISTRAL3_ORIGINAL], tempered[:MINISTRAL3_ORIGINAL])


def test_a_random_ministral3_written_as_gguf_reads_back_as_the_same_model(random_ministral3, smollm2_path, tmp_path,
                                                                          make_llm_for_test):
    """Ministral 3 under llama.cpp's mistral3 (llama's tensors, q / k rows permuted; YaRN's keys, mscale_all_dim as
    the log multiplier, the temperature's scale and period) loads as the model ridge draws."""
    import json

    from conftest import gguf_round_trip

    config = json.loads((random_ministral3[0] / "config.json").read_text())
    config = {**config, "text_config": {**config["text_config"], "vocab_size": 49152}}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert ours.architecture == "ministral3" and ours.attention_temperature == theirs.attention_temperature
    assert ours.rope_scaling.rotation_magnitude() == theirs.rope_scaling.rotation_magnitude() == 1.0
    assert torch.allclose(from_file.engine.loaded.model.rotary.freqs, drawn.engine.loaded.model.rotary.freqs, atol=1e-6)
    assert_same_logits(from_file, drawn)


@pytest.mark.parametrize("wrapper", ["mistral3", "llava"])
def test_a_vision_wrapper_serves_its_language_model_of_the_family_it_names(wrapper, tmp_path, make_llm_for_test):
    """Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2) and LlavaForConditionalGeneration (Pixtral) hold a
    language model of whichever family their text_config names: served as that family for text (HF's logits), with
    Mistral 3's vision tower (images: tests/test_pixtral.py; refused by name here, the tokenizer lacking Pixtral's
    row tokens), without LLaVA's; a family ridge does not run is refused by its name."""
    import json

    from transformers import AutoModelForImageTextToText, LlavaConfig, Mistral3Config

    from conftest import assert_logits_match_hf
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    text = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-5, initializer_range=0.2, sliding_window=None, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 16}
    torch.manual_seed(0)
    kind = Mistral3Config if wrapper == "mistral3" else LlavaConfig
    model = AutoModelForImageTextToText.from_config(kind(text_config=text, vision_config=vision),
                                                    dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    llm = make_llm_for_test(tmp_path, dtype="float32")
    assert llm.engine.loaded.config.architecture == "mistral"
    towers = any("vision" in key or "projector" in key for key in llm.engine.loaded.model.state_dict())
    assert towers == (wrapper == "mistral3")
    if towers:
        with pytest.raises(ValueError, match=r"images: not supported with this tokenizer: it has no \[IMG_BREAK\]"):
            llm.generate({"prompt_token_ids": [5, 10], "multi_modal_data": {"image": b"unread"}})
    assert_logits_match_hf(make_llm_for_test, tmp_path, model, VOCAB)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["model_type"] = "jamba"
    with pytest.raises(ValueError, match="architecture 'jamba' is not supported"):
        config_from_spec(spec_from_hf_config(config, "wrapped"))


def test_gemma_matches_hf_and_reads_back_from_gguf(tmp_path, smollm2_path, make_llm_for_test):
    """Gemma 1 (CodeGemma's too): scaled embeddings, norms multiplying by 1 + w, GeGLU under its legacy "gelu" name
    (HF reads the tanh form): HF's logits, greedy tokens and the fused step, and its GGUF (llama.cpp's gemma, the
    norms stored as 1 + w) read back the same."""
    import json

    from transformers import AutoModelForCausalLM, GemmaConfig

    from conftest import gguf_round_trip

    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         hidden_act="gelu", hidden_activation=None)
    path, model = saved(with_drawn_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()),
                        tmp_path / "hf")
    assert make_llm_for_test(path, dtype="float32").engine.loaded.config.hidden_act == "gelu_tanh"
    assert_family_matches_hf(make_llm_for_test, path, model, VOCAB)
    (tmp_path / "gguf").mkdir()
    from_file, drawn = gguf_round_trip({**json.loads((path / "config.json").read_text()), "vocab_size": 49152},
                                       tmp_path / "gguf", smollm2_path, make_llm_for_test)
    assert_same_logits(from_file, drawn)
