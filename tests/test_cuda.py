"""The CUDA path on a GPU: HF transformers' logits and greedy tokens on random llama / qwen2 / qwen3 configs,
the same tokens with CUDA graphs on and off under every runtime variation, quantized weights on the Triton
kernel, a quantized KV cache read by the Triton attention kernels, seeded sampling on device generators, and
`random:` models.

Skipped without a CUDA GPU (this machine and CI have none): run on a lent GPU machine with
`pytest tests/test_cuda.py tests/test_triton_kernels.py` (scripts/gpu-check.sh does, then measures).
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy_disagreements, random_prompts
from test_models_random import VOCAB, byte_tokenizer, hf_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a lent GPU machine)")

GREEDY_ARGS = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def random_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(request.param, tie=request.param == "qwen3"),
                                             dtype=torch.float32).eval()
    if request.param == "qwen2":  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model.cuda()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_logits_and_greedy_tokens_match_hf(random_model, make_llm_for_test):
    from ridge import SamplingParams

    path, hf = random_model
    llm = make_llm_for_test(path, device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is not None
    for ids in random_prompts(3, VOCAB, 5, 60, seed=1):
        ours = llm.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0]
        assert (ours.to(ref.device) - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
    prompts = random_prompts(4, VOCAB, 5, 40, seed=2)
    for ids, out in zip(prompts, llm.generate(prompts, SamplingParams(**GREEDY_ARGS)), strict=True):
        assert not hf_greedy_disagreements(hf, ids, out.outputs[0].token_ids)


@pytest.mark.parametrize("variant", [
    {},  # a batch of 32
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"kv_cache_memory": 40 * 16 * 3 * 2 * 2 * 16 * 4},  # 40 blocks: preemption
    {"enable_prefix_caching": False},
    {"speculate": "ngram", "num_speculative_tokens": 3},
], ids=["batch32", "tiny-budget", "tiny-pool", "no-prefix-cache", "ngram-speculation"])
def test_graphs_on_and_off_give_the_same_tokens(random_model, make_llm_for_test, variant):
    from ridge import SamplingParams

    path, _ = random_model
    prompts = random_prompts(24, VOCAB, 3, 120, seed=3)
    prompts += [prompts[0][:40] + p for p in random_prompts(8, VOCAB, 3, 20, seed=4)]  # shared prefixes
    params = SamplingParams(**GREEDY_ARGS)
    eager = make_llm_for_test(path, device="cuda", dtype="float32", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    expected = [tokens(eager.generate(p, params))[0] for p in prompts]  # each alone, eagerly: the plain path
    graphs = make_llm_for_test(path, device="cuda", dtype="float32", **variant)
    outs = graphs.generate(prompts, params)
    assert tokens(outs) == expected
    if "kv_cache_memory" in variant:
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8", "mxfp4"])
def test_quantized_weights_run_on_the_triton_kernel(random_model, make_llm_for_test, quantization):
    """The GPU's quantized layers hold codes, not dense copies, and score as the CPU's dequantized math does (mxfp4:
    e2m1 codes where a row's halves start 32-blocks, the 96-column layers widened to bytes)."""
    from ridge.linear.triton import TritonQuantLinear

    path, _ = random_model
    # plain rounding: no calibration text here
    rtn = {"calibration_windows": 0} if quantization in ("int8", "fp8") else {}
    gpu = make_llm_for_test(path, device="cuda", dtype="float32", quantization=quantization, **rtn)
    layers = [m for m in gpu.engine.loaded.model.modules() if isinstance(m, TritonQuantLinear)]
    assert layers and all(m.codes.dtype in (torch.uint8, torch.int8) for m in layers)
    cpu = make_llm_for_test(path, dtype="float32", quantization=quantization, **rtn)
    for ids in random_prompts(2, VOCAB, 5, 40, seed=5):
        ours, ref = gpu.engine.prompt_logits(ids).cpu(), cpu.engine.prompt_logits(ids)
        assert (ours - ref).abs().max().item() < 1e-3 * max(ref.abs().max().item(), 1.0)


@pytest.mark.parametrize("cache", ["fp8", "int8", "int4"])
def test_a_quantized_kv_cache_gives_the_cpu_engine_s_tokens(random_model, make_llm_for_test, cache, tmp_path):
    """The Triton kernels over a quantized cache (decodes, and chunks continuing a cached context) give the greedy
    tokens of the CPU engine over the same format, whose writes store the same bytes (test_kv_quant.py); int4 on
    the fixture's model redrawn with heads 32 wide, the values its scales group (the fixture's are 16 and 24)."""
    from ridge import SamplingParams
    from ridge.attention import CudaQuantizedKVBackend

    path, hf = random_model
    if cache == "int4":
        path = _redrawn_with_head_dim(hf, 32, tmp_path)
    prompts = random_prompts(6, VOCAB, 5, 80, seed=6)
    params = SamplingParams(**GREEDY_ARGS)
    gpu = make_llm_for_test(path, device="cuda", dtype="float32", kv_cache_dtype=cache, max_num_batched_tokens=32)
    assert isinstance(gpu.engine.runner.backend, CudaQuantizedKVBackend) and gpu.engine.runner.graphs is None
    cpu = make_llm_for_test(path, dtype="float32", kv_cache_dtype=cache, max_num_batched_tokens=32)
    assert tokens(gpu.generate(prompts, params)) == tokens(cpu.generate(prompts, params))


def test_lora_adapters_give_the_cpu_engine_s_tokens(random_model, make_llm_for_test, tmp_path):
    """Two adapters and the base model mixed in one batch on the GPU (their steps outside CUDA graphs, the base
    model's inside) give the CPU engine's tokens."""
    from ridge import LoRARequest, SamplingParams
    from ridge.bench.lora import write_random_adapter

    path, _ = random_model
    gpu = make_llm_for_test(path, device="cuda", dtype="float32", enable_lora=True)
    assert gpu.engine.runner.graphs is not None
    cfg = gpu.engine.loaded.config
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(cfg, tmp_path / f"a{i}", 8, i, scale=0.3)))
                for i in range(2)]
    prompts = random_prompts(6, VOCAB, 5, 60, seed=8)
    chosen = [adapters[0], None, adapters[1], None, adapters[0], adapters[1]]
    params = SamplingParams(**GREEDY_ARGS)
    cpu = make_llm_for_test(path, dtype="float32", enable_lora=True)
    on_gpu = tokens(gpu.generate(prompts, params, lora_request=chosen))
    assert on_gpu == tokens(cpu.generate(prompts, params, lora_request=chosen))
    assert on_gpu != tokens(gpu.generate(prompts, params)), "the adapters change no token: the check is empty"


def test_embeddings_match_hf_on_the_gpu(random_model, make_llm_for_test):
    """--runner pooling on CUDA (no graphs: they end in logits): each prompt's last-token embedding, HF's."""
    path, hf = random_model
    llm = make_llm_for_test(path, device="cuda", dtype="float32", runner="pooling")
    assert llm.engine.runner.graphs is None
    prompts = [[7], *random_prompts(4, VOCAB, 5, 60, seed=9)]
    for ids, out in zip(prompts, llm.embed(prompts), strict=True):
        with torch.inference_mode():
            ref = torch.nn.functional.normalize(hf.model(torch.tensor([ids], device="cuda")).last_hidden_state[0, -1],
                                                dim=-1)
        assert (torch.tensor(out.outputs.embedding, device="cuda") - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_an_encoder_s_embeddings_and_scores_run_on_the_gpu(family, tmp_path, make_llm_for_test):
    """An encoder on CUDA (attention to the whole prompt through the CUDA backend's SDPA): mean pooling, HF's (on the
    CPU); its cosine scores run there too."""
    from test_encoders import DOCUMENTS, QUERY, hf_pooled, prompts_of, random_encoder

    path, hf = random_encoder(family, tmp_path / family)
    llm = make_llm_for_test(path, device="cuda", dtype="float32", runner="pooling", pooling_type="mean")
    prompts = [[7], *prompts_of(4, 2, 60, seed=9)]
    for ids, out in zip(prompts, llm.embed(prompts), strict=True):
        assert (torch.tensor(out.outputs.embedding) - hf_pooled(hf, ids, "mean")).abs().max().item() < 1e-4
    assert len(llm.score(QUERY, DOCUMENTS)) == len(DOCUMENTS)  # an embedding model's cosine scores, on the GPU


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_images_run_on_the_gpu(kind, tmp_path, make_llm_for_test):
    """The vision tower and M-RoPE on CUDA, decode steps in CUDA graphs (turning at the cache index plus the prompt's
    rope_delta): HF's greedy tokens (on the CPU)."""
    from test_vision import GREEDY, hf_greedy, pictures, prompt_with, random_vision_model

    path, hf = random_vision_model(kind, tmp_path)
    images = pictures((60, 90), (120, 50))
    head, parts = [5, 17, 40, 41], [[77, 78, 79], [90, 91, 92, 93, 94]]
    llm = make_llm_for_test(path, device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is not None
    got = llm.generate(prompt_with(head, images, parts), GREEDY)[0].outputs[0].token_ids
    assert got == hf_greedy(hf, head, images, parts)


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_gemma3_and_mistral3_images_run_on_the_gpu(family, tmp_path, make_llm_for_test):
    """Gemma 3's image tokens attending both ways through the CUDA backend's SDPA route (a prefix-cache hit that
    ends inside the image continuing it), Mistral 3's rows between breaks: HF's greedy tokens (on the CPU)."""
    import test_gemma3_images
    import test_pixtral

    module = test_gemma3_images if family == "gemma3" else test_pixtral
    path, hf = (module.random_gemma3 if family == "gemma3" else module.random_mistral3)(tmp_path)
    images = test_gemma3_images.pictures((60, 90))
    head, parts = list(range(40, 60)), [[70]]
    llm = make_llm_for_test(path, device="cuda", dtype="float32", block_size=16)
    expected = module.hf_greedy(hf, head, images, parts)
    outs = [llm.generate(module.prompt_with(head, images, parts), module.GREEDY)[0] for _ in range(2)]
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]
    assert outs[1].num_cached_tokens > 0


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4-g32", "int4-g128"])
def test_bfloat16_quantized_layers_match_dequantized_math(fmt):
    """In bfloat16, the GPU's serving dtype: int4 on torch's int4 kernel (tinygemm), and every format on each
    Triton configuration the tuner may pick, within bfloat16's rounding of the dequantized product."""
    from ridge.linear import int4pack
    from ridge.linear.triton import TritonQuantLinear
    from ridge.quant.methods import quantize_weight
    from ridge.quant.rtn import dequantize
    from ridge.triton_kernels import quant_matmul, quant_tuning

    torch.manual_seed(8)
    method, _, group = fmt.partition("-g")
    qw = quantize_weight(torch.randn(256, 1024, device="cuda"), method, int(group or 32), None)
    layer = TritonQuantLinear(qw, None, torch.bfloat16, "cuda")
    assert (layer.int4pack is not None) == (method == "int4")
    if layer.int4pack is None:
        weight = quant_matmul.PackedWeight(layer.codes, layer.kind, layer.scales, layer.minimums, layer.group_size,
                                           256)
    else:  # the Triton kernels on the same codes, as a float16 model would hold them
        weight = quant_matmul.PackedWeight(quant_matmul.pack_nibbles(qw.qweight.to(torch.uint8)),
                                           quant_matmul.NIBBLES, qw.scales.half(), qw.minimums.half(), int(group), 256)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 1024, device="cuda").bfloat16()
        ref = x.float() @ dequantize(qw).T
        tolerance = 2e-2 * ref.abs().max().item()
        assert (layer(x).float() - ref).abs().max().item() < tolerance
        if layer.int4pack is not None:  # widened back from tinygemm's layout, for cuBLAS
            widened = int4pack.dense(layer.int4pack, layer.scales_and_zeros, layer.group_size, torch.bfloat16)
            assert (x.float() @ widened.float().T - ref).abs().max().item() < tolerance
        # the candidates at one row and many (the few-rows ones are the same kernels as at one)
        configs = quant_tuning.TUNER.candidates(x, weight) if rows != 3 else []
        for config in configs:
            out = quant_matmul.quant_matmul(x, weight, config, layer.multiprocessors)
            assert (out.float() - ref).abs().max().item() < tolerance, config


def test_seeded_sampling_repeats_on_the_device(random_model, make_llm_for_test):
    from ridge import SamplingParams

    path, _ = random_model
    llm = make_llm_for_test(path, device="cuda", dtype="float32")
    prompt = random_prompts(1, VOCAB, 10, 11, seed=6)[0]
    seeded = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in (7, 7, 8)]
    first, again, other = tokens(llm.generate([prompt] * 3, seeded))
    assert first == again and first != other


def test_random_preset_model_runs_on_the_gpu(make_llm_for_test):
    from ridge import SamplingParams

    llm = make_llm_for_test("random:smollm2", device="cuda", kv_cache_memory="512MiB")
    (out,) = llm.generate("hello", SamplingParams(**GREEDY_ARGS))
    assert len(out.outputs[0].token_ids) == 24 and "random" in llm.engine.loaded.weight_format


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe",
                                  "mistral4", "llama4", "dots1", "exaone_moe", "mamba2", "bamba", "granitemoehybrid",
                                  "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "nemotron_h", "nemotron_h_moe",
                                  "deepseek_v32", "glm_moe_dsa"])
def test_mixtures_latent_attention_and_state_space_match_hf_on_the_gpu(arch, tmp_path_factory, make_llm_for_test):
    """Issue 46's families on CUDA: HF's float32 logits, and its greedy tokens for prompts up to 150 tokens (latent
    attention's long chunks in the expanded form, its decodes through the Triton kernel; a mixture's experts through
    the fused Triton experts; sparse attention's indexer choosing 16 keys); the mixtures' decodes, latent and sparse
    attention's included, in CUDA graphs, whose tokens equal eager decoding's."""
    import test_moe
    import test_sparse_attention
    import test_ssm

    from ridge import SamplingParams

    state_space = ("mamba2", "bamba", "granitemoehybrid", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "nemotron_h",
                   "nemotron_h_moe")
    sparse = ("deepseek_v32", "glm_moe_dsa")
    family = test_ssm if arch in state_space else test_sparse_attention if arch in sparse else test_moe
    path, hf = family.random_hf_model(arch, tmp_path_factory)
    hf = hf.cuda()
    llm = make_llm_for_test(path, device="cuda", dtype="float32")
    prompts = random_prompts(4, VOCAB, 5, 60, seed=1) + random_prompts(1, VOCAB, 140, 150, seed=3)
    outs = _logits_and_greedy_tokens_match_hf(llm, hf, prompts)
    if arch in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe", "mistral4",
                "llama4", "dots1", "exaone_moe", *sparse):
        assert llm.engine.runner.graphs is not None
        eager = make_llm_for_test(path, device="cuda", dtype="float32", enforce_eager=True)
        assert tokens(eager.generate(prompts, SamplingParams(**GREEDY_ARGS))) == tokens(outs)


@pytest.mark.parametrize("kind", ["dense", "edge", "moe"])
def test_gemma4_matches_hf_on_the_gpu(kind, tmp_path_factory, make_llm_for_test):
    """Gemma 4 on CUDA: its global layers' own heads viewing part of their slots' rows (the Triton kernels' block
    strides), KV-shared layers, per-layer embeddings and the 26B-A4B's experts; HF's float32 logits and greedy tokens,
    and the same tokens with CUDA graphs as eagerly."""
    import test_gemma4

    from ridge import SamplingParams

    changes = {"dense": test_gemma4.DENSE, "edge": test_gemma4.EDGE, "moe": test_gemma4.MOE}[kind]
    path, hf = test_gemma4.random_hf_model(f"cuda-{kind}", changes, tmp_path_factory)
    hf = hf.cuda()
    llm = make_llm_for_test(path, device="cuda", dtype="float32", max_num_batched_tokens=32)
    vocab = test_gemma4.VOCAB
    prompts = random_prompts(4, vocab, 5, 60, seed=1) + random_prompts(1, vocab, 90, 100, seed=3)
    outs = _logits_and_greedy_tokens_match_hf(llm, hf, prompts)
    assert llm.engine.runner.graphs is not None
    eager = make_llm_for_test(path, device="cuda", dtype="float32", enforce_eager=True)
    assert tokens(eager.generate(prompts, SamplingParams(**GREEDY_ARGS))) == tokens(outs)


def test_gpt_oss_matches_hf_on_the_gpu(tmp_path_factory, make_llm_for_test):
    """gpt-oss on CUDA: its sinks in the Triton decode kernel's merge and the prefill kernel's normalisation (a fresh
    prompt's scores made in torch), its windows and biases; HF's float32 logits and greedy tokens, and the same tokens
    with CUDA graphs as eagerly."""
    import test_gpt_oss

    from ridge import SamplingParams

    path, hf = test_gpt_oss.random_hf_gpt_oss(tmp_path_factory)
    hf = hf.cuda()
    llm = make_llm_for_test(path, device="cuda", dtype="float32", max_num_batched_tokens=32)
    prompts = random_prompts(4, VOCAB, 5, 60, seed=1) + random_prompts(1, VOCAB, 90, 100, seed=3)
    outs = _logits_and_greedy_tokens_match_hf(llm, hf, prompts)
    eager = make_llm_for_test(path, device="cuda", dtype="float32", enforce_eager=True)
    assert tokens(eager.generate(prompts, SamplingParams(**GREEDY_ARGS))) == tokens(outs)


def _redrawn_with_head_dim(hf, head_dim: int, directory):
    """`hf`'s configuration with heads head_dim wide, its weights drawn afresh, saved in `directory` (its path)."""
    from transformers import AutoModelForCausalLM

    config = hf.config.__class__.from_dict({**hf.config.to_dict(), "head_dim": head_dim})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def _logits_and_greedy_tokens_match_hf(llm, hf, prompts: list[list[int]]) -> list:
    """Each prompt's float32 logits within 1e-4 of HF's (its model on the GPU), and the engine's greedy tokens HF's
    choices; the outputs, for the runtime checks that follow."""
    from ridge import SamplingParams

    for ids in prompts:
        ours = llm.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0]
        assert (ours.to(ref.device) - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
    outs = llm.generate(prompts, SamplingParams(**GREEDY_ARGS))
    for ids, out in zip(prompts, outs, strict=True):
        assert not hf_greedy_disagreements(hf, ids, out.outputs[0].token_ids)
    return outs
