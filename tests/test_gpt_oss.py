"""gpt-oss on a small random config against HF transformers in float32: attention sinks, alternating sliding-window
and full layers, YaRN rotary, biases on every projection and on the router, clamped SwiGLU experts stored stacked
and interleaved. No gpt-oss checkpoint fits this machine; the shapes are small, the structure the model's."""

import pytest
import torch

from conftest import assert_logits_match_hf, greedy_batch_checked_against_hf, random_prompts
from ridge import SamplingParams
from test_models_random import VOCAB, byte_tokenizer


@pytest.fixture(scope="module")
def random_gpt_oss(tmp_path_factory):
    return random_hf_gpt_oss(tmp_path_factory)


def random_hf_gpt_oss(tmp_path_factory):
    """HF's model of a small random gpt-oss config, saved: (its directory, the model). Sinks and biases drawn (HF
    initialises the experts' biases to zero), a window of 8 so that the prompts pass it, a clamp of 0.8 that the
    random activations reach."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, swiglu_limit=0.8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias,
                         layer.self_attn.o_proj.bias):
                bias.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


@pytest.mark.parametrize("backend", ["paged", "reference"])
def test_logits_match_hf(random_gpt_oss, make_llm_for_test, backend):
    """Prompts of 5-80 tokens, past the window: the sinks in SDPA's chunks (paged) and in the plain softmax."""
    assert_logits_match_hf(make_llm_for_test, *random_gpt_oss, VOCAB, attention_backend=backend)


def test_greedy_tokens_match_hf_and_hold_under_the_runtime(random_gpt_oss, make_llm_for_test, caplog):
    """48 greedy tokens of 5 prompts equal HF's choices in a batch of 16 with 32-token chunks (decodes in the fused
    C++ step: each layer over its KV group's window, each row's output scaled by its softmax denominator's share of
    the sink, the C++ experts); the same tokens in a pool that preempts, from the prefix cache, and through torch's
    decode path (no C++ kernels)."""
    from ridge.models.moe import MoEBlock

    path, hf = random_gpt_oss
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    cfg = llm.engine.loaded.config
    assert (cfg.architecture, cfg.attention_sinks, cfg.global_every, cfg.sliding_window) == ("gpt_oss", True, 2, 8)
    assert "fused decode step has no" not in caplog.text and "experts run in Python" not in caplog.text
    assert llm.engine.runner.decode_stack is not None
    assert all(m.native is not None for m in llm.engine.loaded.model.modules() if isinstance(m, MoEBlock))
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == batch and sum(o.num_cached_tokens for o in again) > 0
    room = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 224  # the longest sequence and a bit
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(room), max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    assert tight.engine.scheduler.num_preemptions > 0
    plain = make_llm_for_test(path, dtype="float32", cpu_kernels=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts[:6], params)] == batch[:6]


@pytest.mark.threaded  # the experts side by side on the threads: on every core
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c_experts_equal_the_python_block(random_gpt_oss, mxfp4_gpt_oss, make_llm_for_test, ops, dtype):
    """gpt-oss's mixture in the C++ stack's form (the experts' biases, the router's logit bias, the clamped SwiGLU;
    MXFP4's codes through their table) against MoEBlock itself, bit for bit, at 1, 3 and 16 tokens."""
    from ridge.kernels.decode_stack import native_experts
    from ridge.models.moe import MoEBlock

    g = torch.Generator().manual_seed(3)
    for path in (random_gpt_oss[0], mxfp4_gpt_oss[1]):
        model = make_llm_for_test(path, dtype=dtype, enforce_eager=True).engine.loaded.model
        with torch.inference_mode():
            for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:
                native = native_experts(ops, block)
                for rows in (1, 3, 16):
                    x = torch.randn(rows, block.router.in_features, generator=g).to(getattr(torch, dtype)) * 3
                    assert torch.equal(native(x), block(x)), (path.name, rows)


@pytest.mark.threaded  # the kernels split their work across threads: on every core
@pytest.mark.parametrize("form", ["float32", "bfloat16", "mxfp4 bfloat16", "int8 cache"])
def test_the_fused_decode_step_is_the_python_path_to_the_bit(random_gpt_oss, mxfp4_gpt_oss, make_llm_for_test, form):
    """Decode steps in one C++ call (windows on alternate layers, the sinks, o_proj's and the experts' biases)
    against every layer in Python (enforce_eager): the same tokens and log-probabilities to the last bit, a batch
    of 6 run past the window."""
    args = {"dtype": form.split()[-1] if form != "int8 cache" else "float32"}
    path = mxfp4_gpt_oss[1] if form.startswith("mxfp4") else random_gpt_oss[0]
    if form == "int8 cache":
        if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            pytest.skip("the stack reads a quantized cache through the AVX512 kernel only (elsewhere it stays off)")
        # the cache kernel's heads are 64 wide: gpt-oss-20b's shape, cut down
        path = ("random:gpt-oss-20b,num_layers=2,hidden_size=128,num_heads=4,num_kv_heads=2,num_experts=4,"
                "experts_per_token=2,moe_intermediate_size=64,vocab_size=320,sliding_window=16")
        args["kv_cache_dtype"] = "int8"
    stacked = make_llm_for_test(path, **args)
    eager = make_llm_for_test(path, enforce_eager=True, **args)
    assert stacked.engine.runner.decode_stack is not None and eager.engine.runner.decode_stack is None
    prompts = random_prompts(6, VOCAB, 3, 30, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_an_int8_cache_keeps_the_float_cache_s_tokens(random_gpt_oss, make_llm_for_test):
    """gpt-oss on an int8 cache (its decodes with the sinks: test_kv_quant checks them against the dequantized rows):
    the float cache's greedy tokens, which without the sinks it would not keep (their logits move the outputs by
    far more than the codes' rounding)."""
    path, _ = random_gpt_oss
    prompts = random_prompts(6, VOCAB, 10, 40, seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = make_llm_for_test(path, dtype="float32")
    coded = make_llm_for_test(path, dtype="float32", kv_cache_dtype="int8")
    assert [o.outputs[0].token_ids for o in coded.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_one_process_s_tokens(random_gpt_oss, make_llm_for_test, expert_parallel):
    """Over two ranks: each its query heads' sinks, its share of every expert's width (or its whole experts), and
    the row-parallel biases (o_proj's, the experts' down) added by rank 0 alone, since the ranks' outputs are
    summed."""
    path, _ = random_gpt_oss
    prompts = random_prompts(4, VOCAB, 5, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB")
    two = make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2,
                            enable_expert_parallel=expert_parallel)
    attn = two.engine.loaded.model.layers[0].attn
    assert attn.sinks.shape == (2,) and attn.o_proj.bias is not None  # rank 0's
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    two.engine.close()


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """A random gpt-oss saved as its published checkpoints are, its experts in MXFP4 (quant/mxfp4.py: gguf's
    quantization, HF's layout), with HF transformers' model of that checkpoint (which dequantizes it on the CPU):
    (the dense checkpoint, the MXFP4 one, HF's model). SmolLM2's vocabulary size, so that a GGUF of it can carry
    SmolLM2's tokenizer; experts 64 wide, two MXFP4 blocks, so that two ranks each take one."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    from ridge.quant import mxfp4

    torch.manual_seed(1)
    config = GptOssConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 1.0)
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    dense, packed = root / "dense", root / "mxfp4"
    model.save_pretrained(dense)
    packed.mkdir()
    state = load_file(dense / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # HF's dense experts are [experts, in, out]; MXFP4's blocks run along the input, per output row
        state[f"{name}_blocks"], state[f"{name}_scales"] = mxfp4.to_hf(state.pop(name).transpose(1, 2).contiguous())
    save_file(state, packed / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((dense / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4",
                                        "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(hf_config))
    byte_tokenizer().save(str(packed / "tokenizer.json"))
    return dense, packed, AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32).eval()


def test_mxfp4_layouts_hold_hf_s_and_gguf_s_numbers():
    """quant/mxfp4.py's codes and scales, from HF's layout and from GGUF's blocks, are the numbers HF transformers'
    and gguf's own dequantizers give, to the bit, over exponents far apart (2^-100 to 2^20: the scale's whole
    range that float32 weights reach)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ridge.quant import gguf_blocks, mxfp4
    from ridge.quant.rtn import dequantize

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 256, generator=generator) * torch.pow(2.0, torch.randint(-100, 20, (16, 1),
                                                                                        generator=generator))
    blocks, exponents = mxfp4.to_hf(weight)
    hf = convert_moe_packed_tensors(blocks[None], exponents[None], dtype=torch.float32)[0].T  # [out, in]
    assert torch.equal(dequantize(mxfp4.from_hf(blocks, exponents)).float(), hf)
    raw = gguf_quantize(weight.numpy(), GGMLQuantizationType.MXFP4)
    theirs = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.MXFP4))
    assert torch.equal(theirs, hf)  # the two layouts hold the same numbers
    unpacked = gguf_blocks.unpack(raw, GGMLQuantizationType.MXFP4, (16, 256))
    assert torch.equal(unpacked.levels, mxfp4.LEVELS) and torch.equal(unpacked.qweight,
                                                                      mxfp4.from_hf(blocks, exponents).qweight)
    assert torch.equal(dequantize(unpacked).float(), theirs)
    assert np.array_equal(gguf_blocks.dequantize(raw, GGMLQuantizationType.MXFP4, (16, 256)), theirs.numpy())


def test_mxfp4_experts_match_hf(mxfp4_gpt_oss, make_llm_for_test):
    """The published checkpoints' form: each expert's MXFP4 blocks read as 4-bit codes into MXFP4's table with a
    power-of-two scale per 32 (exact), on the grouped kernel; float32 logits HF's within 1e-4 of the scale."""
    _, packed, hf = mxfp4_gpt_oss
    assert_logits_match_hf(make_llm_for_test, packed, hf, 49152)
    llm = make_llm_for_test(packed, dtype="float32")
    assert "mxfp4 experts" in llm.engine.loaded.weight_format
    experts = [e for layer in llm.engine.loaded.model.layers for e in layer.mlp.experts]
    # 4-bit codes as the checkpoint holds them, two a byte, looked up in the kernel's registers
    assert all(e.gate_up.kernel == e.down.kernel == "grouped_int8" and e.gate_up.levels.numel() == 16
               and e.gate_up.qweight.nbytes * 2 == e.gate_up.in_features * e.gate_up.out_features for e in experts)


def test_a_gguf_of_it_matches_hf_read_or_run_as_blocks(mxfp4_gpt_oss, smollm2_path, tmp_path, make_llm_for_test):
    """The model as llama.cpp's gpt-oss GGUF holds it (bench/random_gguf.py: gate and up split, the experts'
    biases stacked, post_attention_norm before the MLP, attn_sinks, experts in MXFP4 blocks, the rest float32):
    the header reads back as the HF config's model, and the logits are HF's (of the MXFP4 checkpoint), dequantized
    at load or run on the blocks (--quantization gguf)."""
    import dataclasses

    from ridge.bench.random_gguf import write_gguf
    from ridge.models.gguf_file import read_gguf
    from ridge.models.loader import load_model

    dense, packed, hf = mxfp4_gpt_oss
    loaded = load_model(dense, torch.float32, progress=False)
    path = write_gguf(loaded, tmp_path / "gpt-oss.gguf", smollm2_path, float16=False, block_type="MXFP4")
    kinds = {t.name.removeprefix("blk.0."): t.tensor_type.name for t in read_gguf(path).tensors}
    assert kinds["ffn_gate_exps.weight"] == kinds["ffn_down_exps.weight"] == "MXFP4"
    assert kinds["attn_q.weight"] == kinds["ffn_gate_exps.bias"] == kinds["attn_sinks.weight"] == "F32"
    for args in ({}, {"quantization": "gguf"}):
        assert_logits_match_hf(make_llm_for_test, path, hf, 49152, **args)
    ours = make_llm_for_test(path, dtype="float32", quantization="gguf").engine.loaded
    assert dataclasses.replace(ours.spec, rms_norm_eps=loaded.spec.rms_norm_eps, name=loaded.spec.name,
                               source=loaded.spec.source) == loaded.spec  # GGUF keeps eps in float32
    assert ours.config.rope_scaling == loaded.config.rope_scaling and not ours.config.rope_scaling.truncate
    experts = [e for layer in ours.model.layers for e in layer.mlp.experts]
    assert all(e.gate_up.kernel == e.down.kernel == "grouped_int8" for e in experts)


def test_mxfp4_over_two_ranks_and_a_truncated_checkpoint(mxfp4_gpt_oss, make_llm_for_test, tmp_path):
    """Two ranks each read their MXFP4 blocks of every expert (the down projection's columns cut on a block's
    bounds: the plan's granule is the checkpoint's 32), or their whole experts, and give one process's tokens; a
    checkpoint missing a layer's scales is refused by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, packed, _ = mxfp4_gpt_oss
    prompts = random_prompts(3, 49152, 5, 30, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = make_llm_for_test(packed, dtype="float32", kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    for expert_parallel in (False, True):  # each rank its blocks of every expert, or its whole experts
        two = make_llm_for_test(packed, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2,
                                enable_expert_parallel=expert_parallel)
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected
        two.engine.close()

    truncated = tmp_path / "truncated"
    shutil.copytree(packed, truncated)
    state = load_file(packed / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, truncated / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks: MXFP4 blocks without "
                                         r"their scales"):
        make_llm_for_test(truncated, dtype="float32")


def test_mxfp4_on_another_architecture_is_refused(tmp_path):
    """MXFP4 is read for gpt-oss's experts, its only user: on another architecture's config refused by name rather
    than loaded otherwise."""
    import json

    from ridge.models.loader import load_model
    from test_models_random import hf_config

    config = {**hf_config("llama", False).to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method: 'mxfp4' is read for gpt-oss's experts only; .* is llama"):
        load_model(tmp_path, torch.float32, progress=False)
