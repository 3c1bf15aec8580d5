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
    """Sinks and biases drawn (HF initialises the experts' biases to zero), a window of 8 so that the prompts
    pass it, a clamp of 0.8 that the random activations reach."""
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
    """48 greedy tokens of 5 prompts equal HF's choices in a batch of 16 with 32-token chunks (decodes through the
    C++ kernel, each row's output scaled by its softmax denominator's share of the sink); the same tokens in a
    pool that preempts, from the prefix cache, and through torch's decode path (no C++ kernels). The fused decode
    step and the C++ experts say they cannot serve it."""
    path, hf = random_gpt_oss
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    cfg = llm.engine.loaded.config
    assert (cfg.architecture, cfg.attention_sinks, cfg.global_every, cfg.sliding_window) == ("gpt_oss", True, 2, 8)
    assert "attention sinks" in caplog.text and "the mixture's experts run in Python" in caplog.text
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == batch and sum(o.num_cached_tokens for o in again) > 0
    room = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 224  # the longest sequence and a bit
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(room), max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    assert tight.engine.scheduler.num_preemptions > 0
    plain = make_llm_for_test(path, dtype="float32", cpu_kernels=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts[:6], params)] == batch[:6]


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


def test_the_cuda_backends_refuse_the_sinks():
    """The Triton kernels attend without sinks: the engine refuses a model with them there (ModelRunner), on the
    quantized CUDA cache too (whose other parent, the CPU's quantized cache, handles them)."""
    from ridge.attention.cuda import CudaBackend, CudaQuantizedKVBackend
    from ridge.attention.quantized_kv import QuantizedKVBackend

    assert QuantizedKVBackend.handles_sinks and not CudaBackend.handles_sinks
    assert not CudaQuantizedKVBackend.handles_sinks


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


def test_what_cannot_run_is_refused(random_gpt_oss, make_llm_for_test, tmp_path):
    """The published checkpoints' MXFP4 experts have no reader here: refused by name rather than run otherwise."""
    import json
    import shutil

    path, _ = random_gpt_oss
    shutil.copytree(path, tmp_path / "mxfp4")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method: 'mxfp4' is not one of gptq, awq, fp8"):
        make_llm_for_test(tmp_path / "mxfp4", dtype="float32")
    llm = make_llm_for_test(path, dtype="float32")  # the engine serves after the refusals
    assert llm.generate(random_prompts(1, VOCAB, 5, 6)[0], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
