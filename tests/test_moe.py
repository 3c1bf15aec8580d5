"""Mixtures of experts (mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe with its shared MLP), DeepSeek-V2 (latent
attention, a softmax router within groups, YaRN) and DeepSeek-V3 (latent attention, a sigmoid group-limited router,
shared experts, a dense first layer) on small random configs against HF transformers: logits, greedy tokens in a
batch of 16 mixed lengths (one longer than the chunk budget), the runtime-invariance checks, quantized experts, the
weights a decode step reads against the plan's active bytes, and the KV the engine holds against the plan's (for
DeepSeek-V3, one latent row a token)."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    GRANITE_SCALARS,
    assert_logits_match_hf,
    greedy_batch_checked_against_hf,
    linears_of_one_decode,
    random_prompts,
)
from ridge import SamplingParams
from test_models_random import byte_tokenizer

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def hf_config(arch: str):
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Ernie4_5_MoeConfig,
        Glm4MoeConfig,
        Glm4MoeLiteConfig,
        GraniteMoeSharedConfig,
        MiniMaxM2Config,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    if arch == "mixtral":  # top-2 of 8, always renormalised
        return MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # a gated shared expert, a dense layer among the sparse ones, top-k not renormalised
        return Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                              mlp_only_layers=[1], norm_topk_prob=False)
    if arch == "qwen3_moe":  # top-3, renormalised; per-head q/k norms and a head_dim of its own
        return Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=3, head_dim=24, norm_topk_prob=True)
    if arch == "olmoe":  # q/k norms over all heads
        return OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if arch == "granitemoe":  # Granite 3's shared form: stacked experts, an ungated shared MLP, Granite's scalars
        return GraniteMoeSharedConfig(**COMMON, intermediate_size=32, shared_intermediate_size=48,
                                      num_local_experts=8, num_experts_per_tok=2, **GRANITE_SCALARS)
    if arch == "deepseek_v2":  # V2-Lite's form: no query bottleneck; a softmax router within the groups of the
        # best single scores, scaled; YaRN with DeepSeek's mscale (positions past 64 are past the original context)
        return DeepseekV2Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, q_lora_rank=None,
                                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, n_shared_experts=1, topk_method="group_limited_greedy",
                                n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707})
    if arch == "glm4_moe":  # GLM-4.5: DeepSeek-V3's router (here within 2 groups) and shared experts beside llama
        # attention with q / k / v biases, per-head q / k norms and half of each head rotary; a dense first layer
        return Glm4MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                             topk_group=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True)
    if arch == "minimax_m2":  # q and k normed over all heads, half of each head rotary (its checkpoints' rotary_dim),
        # a sigmoid router with the correction bias, renormalised
        return MiniMaxM2Config(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                               rotary_dim=8)
    if arch == "ernie4_5_moe":  # Ernie 4.5: softmax scores chosen with a per-expert bias, renormalised, beside a
        # shared expert after a dense first layer; every head's rotary in interleaved pairs
        return Ernie4_5_MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                                  moe_num_shared_experts=1, moe_layer_start_index=1)
    if arch == "glm4_moe_lite":  # GLM-4.7-Flash: DeepSeek-V3's latent attention and router, its dense layers listed
        # per layer (here one among the sparse ones)
        return Glm4MoeLiteConfig(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, q_lora_rank=24,
                                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 n_shared_experts=1, routed_scaling_factor=1.8,
                                 mlp_layer_types=["sparse", "dense", "sparse"])
    if arch == "mistral4":  # Mistral 4: DeepSeek-V3's latent attention and layout, softmax scores in groups rated
        # by their two best, no correction bias; YaRN over an original 32 positions and the attention temperature
        from transformers import Mistral4Config

        return Mistral4Config(**{**COMMON, "num_key_value_heads": 4},
                              intermediate_size=96, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
                              topk_group=1, routed_scaling_factor=1.5,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "llama_4_scaling_beta": 0.5})
    if arch == "llama4":  # Llama 4: a sigmoid router whose experts read their tokens times the scores, a shared
        # expert, experts on every second layer; chunked attention (32) on 3 of 4 layers, the fourth NoPE with its
        # queries tempered (every 16 positions here), q / k L2-normed; llama3 rotary in interleaved pairs
        from transformers import Llama4TextConfig

        return Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, intermediate_size=32,
                                intermediate_size_mlp=96, num_local_experts=8, num_experts_per_tok=2,
                                interleave_moe_layer_step=2, attention_chunk_size=32, floor_scale=16, attn_scale=0.5,
                                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64})
    if arch == "dots1":  # dots.llm1: Qwen3's attention (a KV head per query head, as its checkpoints) beside
        # DeepSeek-V3's router (within 2 groups), shared experts and a dense first layer
        from transformers import Dots1Config

        return Dots1Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32,
                           n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                           topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0, sliding_window=None)
    if arch == "exaone_moe":  # K-EXAONE: EXAONE 4's attention (windows of 24 on 3 of 4 layers, the fourth global
        # without rotary) with pre-norms, DeepSeek-V3's router within 2 groups, a shared expert, a dense first layer
        from transformers import ExaoneMoeConfig

        return ExaoneMoeConfig(**{**COMMON, "num_hidden_layers": 4}, intermediate_size=96, moe_intermediate_size=32,
                               num_experts=8, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                               n_group=2, topk_group=1, routed_scaling_factor=2.0, sliding_window=24,
                               sliding_window_pattern=4)
    if arch == "deepseek_v3-q":  # the query without its bottleneck, every layer dense
        return DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, q_lora_rank=None,
                                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                first_k_dense_replace=3, n_routed_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1)
    return DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, q_lora_rank=24,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5)


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
                "minimax_m2", "ernie4_5_moe", "mistral4", "llama4", "dots1", "exaone_moe"]
WINDOWED = ("llama4", "exaone_moe")  # their windows' blocks: tests/test_sliding_window.py


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request, tmp_path_factory):
    return random_hf_model(request.param, tmp_path_factory)


def random_hf_model(arch: str, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config(arch)
    if arch == "mistral4":  # not among AutoModelForCausalLM's classes
        from transformers.models.mistral4.modeling_mistral4 import Mistral4ForCausalLM

        model = Mistral4ForCausalLM(config).float().eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # HF starts norms at 1: make them matter
            torch.nn.init.normal_(param, 1.0, 0.3)
    for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
        if name.endswith("e_score_correction_bias"):  # HF starts it at 0: make it move the choice
            with torch.no_grad():
                torch.nn.init.normal_(tensor, 0.0, 0.1)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_logits_match_hf(moe_model, make_llm_for_test):
    assert_logits_match_hf(make_llm_for_test, *moe_model, VOCAB)


def test_latent_attention_without_a_query_bottleneck(tmp_path_factory, make_llm_for_test):
    assert_logits_match_hf(make_llm_for_test, *random_hf_model("deepseek_v3-q", tmp_path_factory), VOCAB)


def test_glm_4_7_flash_runs_as_deepseek_v3(tmp_path_factory, make_llm_for_test):
    path, hf = random_hf_model("glm4_moe_lite", tmp_path_factory)
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    assert (cfg.architecture, cfg.dense_layers, cfg.kv_lora_rank) == ("deepseek_v3", (1,), 32)
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)


def test_a_checkpoint_s_multi_token_prediction_layer_is_left_out(tmp_path_factory, make_llm_for_test):
    """GLM-4.5's and DeepSeek-V3's checkpoints store their multi-token prediction layer as one more decoder layer
    (num_nextn_predict_layers): ridge reads the decoder's layers, HF's logits, and leaves the drafter out."""
    import json

    from safetensors.torch import save_file

    path, hf = random_hf_model("glm4_moe", tmp_path_factory)
    layers = hf.config.num_hidden_layers
    save_file({f"model.layers.{layers}.eh_proj.weight": torch.ones(64, 128),
               f"model.layers.{layers}.self_attn.q_proj.weight": torch.ones(64, 64)}, path / "mtp.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)


def test_greedy_tokens_match_hf_and_hold_under_the_runtime(moe_model, make_llm_for_test):
    """48 greedy tokens of 5 prompts equal HF's, decoded in a batch of 16 mixed lengths with 32-token prefill
    chunks (one prompt is 3 chunks long); alone, in a pool that preempts, and without the prefix cache, the
    batch's tokens do not change."""
    path, hf = moe_model
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    cfg = llm.engine.loaded.config
    room = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 224  # the longest sequence and a bit: 224 tokens
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(room), enable_prefix_caching=False,
                              max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("moe_model", ["qwen2_moe", "deepseek_v3"], indirect=True)  # shared experts, two routers
def test_quantized_experts_run_on_the_dense_kernels(moe_model, make_llm_for_test):
    from ridge.linear import GroupedInt8Linear
    from ridge.models.moe import MoEBlock, Router

    path, _ = moe_model
    llm = make_llm_for_test(path, dtype="float32", quantization="int8")
    blocks = [m for m in llm.engine.loaded.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(isinstance(e.gate_up, GroupedInt8Linear) and isinstance(e.down, GroupedInt8Linear)
                          for b in blocks for e in b.experts)
    assert all(type(b.router) is Router for b in blocks)  # the router keeps its weights as they are
    plain = make_llm_for_test(path, dtype="float32")
    ids = random_prompts(1, VOCAB, 30, 31, seed=5)[0]
    quantized, reference = llm.engine.prompt_logits(ids), plain.engine.prompt_logits(ids)
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.threaded  # the experts side by side on the threads: on every core
def test_the_decode_stack_s_experts_equal_the_python_block(moe_model, make_llm_for_test, ops):
    """Every router (softmax and renormalised or not, DeepSeek's groups, sigmoid scores with their bias, shared
    experts gated or not) in the C++ stack's form against MoEBlock itself, bit for bit: one token, a few, and
    more experts than threads or fewer (the experts run side by side, or one after another on every thread)."""
    from ridge.kernels.decode_stack import native_experts
    from ridge.models.moe import MoEBlock

    path, _ = moe_model
    model = make_llm_for_test(path, dtype="float32", enforce_eager=True).engine.loaded.model
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    g = torch.Generator().manual_seed(3)
    cores = torch.get_num_threads()
    with torch.inference_mode():
        for block in blocks:
            native = native_experts(ops, block)
            for rows in (1, 3, 16):
                x = torch.randn(rows, block.router.in_features, generator=g)
                for threads in {1, cores}:
                    torch.set_num_threads(threads)
                    assert torch.equal(native(x), block(x)), (rows, threads)
    torch.set_num_threads(cores)


# the stack's architectures (all but OLMoE's q / k norms over all heads); 4-bit groups of 32 need widths in 32s,
# which Qwen3-MoE's config has
STACK_CASES = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}), "qwen3_moe": ("qwen3_moe", {}),
               "deepseek_v2": ("deepseek_v2", {}), "deepseek_v3": ("deepseek_v3", {}), "glm4_moe": ("glm4_moe", {}),
               "minimax_m2": ("minimax_m2", {}), "ernie4_5_moe": ("ernie4_5_moe", {}), "mistral4": ("mistral4", {}),
               "llama4": ("llama4", {}), "llama4-bf16": ("llama4", {"dtype": "bfloat16"}), "dots1": ("dots1", {}),
               "exaone_moe": ("exaone_moe", {}),
               "deepseek_v2-int8-bf16": ("deepseek_v2", {"quantization": "int8", "dtype": "bfloat16"}),
               "mixtral-int8": ("mixtral", {"quantization": "int8"}),
               "qwen2_moe-int8": ("qwen2_moe", {"quantization": "int8"}),
               "qwen3_moe-int4-bf16": ("qwen3_moe", {"quantization": "int4", "dtype": "bfloat16"}),
               "qwen3_moe-int8-bf16": ("qwen3_moe", {"quantization": "int8", "dtype": "bfloat16"}),
               "olmoe": ("olmoe", {}),  # q and k normed over all their heads at once
               "olmoe-bf16": ("olmoe", {"dtype": "bfloat16"})}


@pytest.mark.threaded
@pytest.mark.parametrize("moe_model,args", list(STACK_CASES.values()), ids=list(STACK_CASES), indirect=["moe_model"])
def test_the_decode_stack_serves_mixtures_as_the_python_path_does(moe_model, args, make_llm_for_test):
    """The same tokens and log-probabilities to the last bit, a batch of 6 at different lengths, with experts on
    every kind of kernel the stack calls side by side (quantized ones split their work with OpenMP inside)."""
    from conftest import assert_stack_equals_eager

    path, _ = moe_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert_stack_equals_eager(make_llm_for_test, path, random_prompts(6, VOCAB, 3, 40, seed=5), params,
                              **{"dtype": "float32", **args})


@pytest.mark.threaded
@pytest.mark.parametrize("moe_model", ["olmoe"], indirect=True)
def test_steps_the_stack_does_not_take_run_their_experts_in_c(moe_model, make_llm_for_test):
    """Steps outside the stack (here every one: its stack taken away, as a tensor-parallel OLMoE's is refused)
    still call the C++ experts from the MoE blocks: the same tokens and log-probabilities as the Python blocks
    (enforce_eager), prompt and decode."""
    from ridge.models.moe import MoEBlock

    path, _ = moe_model
    native = make_llm_for_test(path, dtype="float32")
    eager = make_llm_for_test(path, dtype="float32", enforce_eager=True)
    native.engine.runner.decode_stack = None
    blocks = [m for m in native.engine.loaded.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.native is not None for b in blocks)
    assert all(m.native is None for m in eager.engine.loaded.model.modules() if isinstance(m, MoEBlock))
    prompts = random_prompts(6, VOCAB, 3, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    for a, b in zip(native.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_decode_step_reads_the_active_experts_only(moe_model, make_llm_for_test):
    """Weights whose matmul a batch-1 decode step runs, counted by hooks, against the plan's bytes for the active
    parameters (the routed experts chosen, the shared expert, attention, routers, the output head)."""
    from ridge.linear import model_weight_bytes
    from ridge.plan.arithmetic import count_parameters, decode_weight_bytes

    path, _ = moe_model
    # hooks see the Python path's modules; the C++ stack runs the same experts' kernels (the tests above)
    engine = make_llm_for_test(path, dtype="float32", enforce_eager=True).engine
    touched = linears_of_one_decode(engine, random_prompts(1, VOCAB, 20, 21, seed=6)[0])
    model = engine.loaded.model
    read = sum(m.weight.numel() * 4 for m in touched)
    read += sum(layer.attn.kv_b.nbytes for layer in model.layers if hasattr(layer.attn, "kv_b"))  # MLA's up-projection
    if model.output_projection is None:  # the head multiplies by the weight itself (no module to hook)
        read += model.output_weight.numel() * 4
    spec = engine.loaded.spec
    planned = decode_weight_bytes(spec, "fp32", batch=1) - count_parameters(spec).norms * 2
    assert abs(read - planned) / planned < 0.02, (read, planned)
    everything = sum(p.numel() * 4 for name, p in model.named_parameters() if "embed" not in name)
    assert read < 0.7 * everything  # the unchosen experts are most of the layers' weights
    unhooked = sum(p.nbytes for name, p in model.layers.named_parameters()  # read, but by no linear layer
                   if "norm" in name or name.endswith("router_bias"))
    assert model_weight_bytes(model, batch=1) == pytest.approx(read + unhooked)  # what the benchmarks divide by


@pytest.mark.parametrize("moe_model", [f for f in MOE_FAMILIES if f not in WINDOWED], indirect=True)
def test_the_kv_the_engine_holds_is_the_plan_s(moe_model, make_llm_for_test):
    from ridge.plan.arithmetic import kv_bytes

    path, _ = moe_model
    llm = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(random_prompts(1, VOCAB, 100, 101, seed=7)[0],
                       SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    while engine.sequences("0")[0].num_outputs < 59:
        engine.step()
    seq = engine.sequences("0")[0]
    held = sum(len(table) for table in seq.block_tables) * engine.config.block_size
    per_token = engine.loaded.config.kv_bytes_per_block(torch.float32, engine.config.block_size) \
        // engine.config.block_size
    assert per_token * seq.num_computed == kv_bytes(engine.loaded.spec, "fp32", seq.num_computed)
    assert held * per_token == kv_bytes(engine.loaded.spec, "fp32", held)  # whole blocks of the same bytes
    while engine.has_unfinished:
        engine.step()


def test_llama4_as_llama_cpp_fixes_it_round_trips_through_gguf(smollm2_path, tmp_path, make_llm_for_test):
    """llama.cpp's llama4 fixes the 8,192-token chunks, the NoPE layers' temperature (0.1 every 8,192 positions) and
    whether q / k are L2-normed (unless 128 experts): a Llama 4 of those, written as a GGUF, reads back as the model
    ridge draws (the same config and logits); one with other chunks is refused by name rather than written as what
    llama.cpp would run differently."""
    import dataclasses

    from conftest import gguf_round_trip

    config = {**hf_config("llama4").to_dict(), "vocab_size": 49152, "attention_chunk_size": 8192,
              "floor_scale": 8192, "attn_scale": 0.1}
    (tmp_path / "fixed").mkdir()
    from_file, drawn = gguf_round_trip(config, tmp_path / "fixed", smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    # the file holds llama3's scaling as its divisors (rope_freqs): the same frequencies
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps, rope_scaling=theirs.rope_scaling) == theirs
    assert torch.allclose(from_file.engine.loaded.model.rotary.freqs, drawn.engine.loaded.model.rotary.freqs, atol=1e-6)
    assert ours.chunked_window and ours.dense_layers == (0, 2) and ours.attention_temperature.nope_layers_only
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="llama4 has 8192-token chunks"):
        gguf_round_trip({**config, "attention_chunk_size": 32}, tmp_path / "other", smollm2_path, make_llm_for_test)


@pytest.mark.parametrize("change,field", [({"clip_qkv": 8.0}, "clip_qkv"),
                                          ({"hidden_act": "relu"}, "hidden_act"),
                                          ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                                            "kv_lora_rank": 32, "qk_rope_head_dim": 8, "topk_method": "noaux_tc"},
                                           "topk_method 'noaux_tc'"),
                                          ({"moe_layer_freq": 2}, "moe_layer_freq"),
                                          ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling")])
def test_what_ridge_does_not_implement_is_refused_by_name(change, field):
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config("olmoe").to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        config_from_spec(spec_from_hf_config(config, "olmoe"))


@pytest.mark.parametrize("change,field", [({"attn_type_list": [0, 1, 1]}, "attn_type_list"),
                                          ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
                                          ({"scoring_func": "softmax"}, "scoring_func"),
                                          ({"use_routing_bias": False}, "use_routing_bias")])
def test_minimax_layers_m2_does_not_have_are_refused_by_name(change, field):
    """MiniMax's configs can say more than M2's layers do (MiniMax-01's lightning attention, a shared expert, other
    routers): refused by name. Its checkpoints' rotary_dim alone gives the rotary part of each head."""
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = hf_config("minimax_m2").to_dict()
    with pytest.raises(ValueError, match=field):
        config_from_spec(spec_from_hf_config({**config, **change}, "minimax_m2"))
    published = {**config, "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"}}
    assert config_from_spec(spec_from_hf_config(published, "minimax_m2")).rotary_dim == 8


# llama's rotary rows, a shared expert (gated; Granite's ungated, with its scalars), latent attention (interleaved
# rotary rows, kv_b split) with both routers
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "deepseek_v2", "deepseek_v3",
                                  "glm4_moe", "minimax_m2", "ernie4_5_moe", "mistral4", "dots1", "exaone_moe"])
def test_a_random_mixture_written_as_gguf_reads_back_as_the_same_model(arch, smollm2_path, tmp_path,
                                                                      make_llm_for_test):
    """`random:NAME` written under llama.cpp's names and header (bench/random_gguf.py, in float32) loads from the
    file as the model ridge draws for that name: the same logits."""
    import dataclasses

    from conftest import gguf_round_trip

    config = {**hf_config(arch).to_dict(), "vocab_size": 49152, "mlp_only_layers": []}  # GGUF: experts everywhere
    if arch == "dots1":  # llama.cpp's dots1 routes without groups (the writer refuses them)
        config.update(n_group=1, topk_group=1)
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs  # GGUF keeps eps in float32
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def test_a_random_mixture_in_q8_0_blocks_runs_them_natively(smollm2_path, tmp_path, make_llm_for_test):
    """A random Qwen3-MoE written with Q8_0 matrices (bench/random_gguf.py's block_type: what ridge and llama.cpp
    run side by side) loads with its experts on GGUF blocks, decodes through the fused stack, and stays the drawn
    model within Q8_0's rounding."""
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.gguf_file import read_gguf
    from ridge.models.moe import MoEBlock
    from ridge.models.random_weights import random_spec

    config = {**hf_config("qwen3_moe").to_dict(), "vocab_size": 49152, "mlp_only_layers": []}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = random_spec(f"random:{tmp_path}")
    path = write_random_gguf(spec, tmp_path / "model.gguf", smollm2_path, seed=0, block_type="Q8_0")
    assert read_gguf(path).metadata["general.file_type"] == 7  # llama.cpp's MOSTLY_Q8_0
    from_file = make_llm_for_test(path, dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    blocks = [m for m in from_file.engine.loaded.model.modules() if isinstance(m, MoEBlock)]
    # Q8_0's blocks of 32 as int8 codes with a scale a group, on the grouped int8 kernel, read as stored
    assert blocks and all(e.gate_up.kernel == e.down.kernel == "grouped_int8" for b in blocks for e in b.experts)
    assert from_file.engine.runner.decode_stack is not None
    drawn = make_llm_for_test(f"random:{tmp_path}", dtype="float32", kv_cache_memory="16MiB")
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    quantized, reference = from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids)
    # Q8_0's rounding moves each row's logits by at most `error`: its top token can change only where the drawn
    # model's two best are nearer than twice that (a random model's logits are nearly flat: half its rows here)
    error = (quantized - reference).abs().amax(-1)
    assert error.max() < 0.05 * reference.abs().max()
    best = reference.topk(2, dim=-1).values
    clear = best[:, 0] - best[:, 1] > 2 * error
    assert clear.sum() >= 5 and (quantized.argmax(-1) == reference.argmax(-1))[clear].all()
    with pytest.raises(ValueError, match="block_type: 'Q4_K' is not one of Q8_0"):
        write_random_gguf(spec, tmp_path / "other.gguf", smollm2_path, block_type="Q4_K")


def _rewrite_gguf(source, target, keys: dict, tensors) -> None:
    """`source` GGUF written again at `target` with header `keys` changed (None: dropped) and its tensors passed
    through `tensors(name, array) -> [(name, array, quantization type or None)]`."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or keys.get(key, 0) is None:
            continue
        if key in keys:
            writer.add_key_value(key, keys[key], field.types[0])
        elif len(field.types) > 1:
            writer.add_array(key, [field.contents(i) for i in range(len(field.data))])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    arrays = {t.name: t.data.reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    for name, array in arrays.items():
        for out_name, out, kind in tensors(name, array, arrays):
            writer.add_tensor(out_name, out, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


@pytest.fixture(scope="module")
def deepseek_v2_gguf(smollm2_path, tmp_path_factory):
    """DeepSeek-V2's small config as a float32 GGUF of llama.cpp's current form, and the name of its weights."""
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    folder = tmp_path_factory.mktemp("deepseek2")
    (folder / "config.json").write_text(json.dumps({**hf_config("deepseek_v2").to_dict(), "vocab_size": 49152}))
    spec = random_spec(f"random:{folder}")
    return write_random_gguf(spec, folder / "model.gguf", smollm2_path, seed=0, float16=False), f"random:{folder}"


def test_an_older_deepseek2_gguf_with_kv_b_whole_reads_as_the_same_model(deepseek_v2_gguf, tmp_path,
                                                                         make_llm_for_test):
    """llama.cpp's converter wrote deepseek2 files before mid-2025 with attn_kv_b whole and the per-head key and
    value widths in key_length / value_length: ridge reads them as the current form."""
    import numpy as np

    current, drawn_name = deepseek_v2_gguf
    older = tmp_path / "older.gguf"

    def whole_kv_b(name, array, arrays):
        if name.endswith("attn_v_b.weight"):
            return []
        if name.endswith("attn_k_b.weight"):  # [heads, rank, nope] and [heads, v, rank] -> [heads * (nope + v), rank]
            joined = np.concatenate([array.transpose(0, 2, 1), arrays[name.replace("attn_k_b", "attn_v_b")]], axis=1)
            return [(name.replace("attn_k_b", "attn_kv_b"), joined.reshape(-1, joined.shape[-1]).copy(), None)]
        return [(name, array, None)]

    _rewrite_gguf(current, older, {"deepseek2.attention.head_count_kv": 4, "deepseek2.attention.key_length": 24,
                                   "deepseek2.attention.value_length": 16, "deepseek2.attention.key_length_mla": None,
                                   "deepseek2.attention.value_length_mla": None}, whole_kv_b)
    from_file = make_llm_for_test(older, dtype="float32", kv_cache_memory="16MiB")
    drawn = make_llm_for_test(drawn_name, dtype="float32", kv_cache_memory="16MiB")
    ids = random_prompts(1, 49152, 20, 21, seed=6)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def test_a_quantized_deepseek2_gguf_runs_its_blocks_natively(deepseek_v2_gguf, tmp_path, make_llm_for_test):
    """Q8_0 projections kept as blocks (--quantization gguf): the query's and kv_a's rotary rows reordered with
    their codes and scales, kv_b and the router dequantized; the logits those of the same file dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    current, _ = deepseek_v2_gguf
    quantized = tmp_path / "q8_0.gguf"

    def q8_0(name, array, arrays):
        if array.ndim == 2 and not name.startswith("token_embd"):
            return [(name, quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)]
        return [(name, array, None)]

    _rewrite_gguf(current, quantized, {}, q8_0)
    native = make_llm_for_test(quantized, dtype="float32", quantization="gguf", kv_cache_memory="16MiB")
    attention = native.engine.loaded.model.layers[0].attn
    assert type(attention.q_proj) is not torch.nn.Linear and type(attention.kv_a) is not torch.nn.Linear
    assert isinstance(attention.kv_b, torch.nn.Parameter)
    dequantized = make_llm_for_test(quantized, dtype="float32", kv_cache_memory="16MiB")
    ids = random_prompts(1, 49152, 20, 21, seed=7)[0]
    ours, reference = native.engine.prompt_logits(ids), dequantized.engine.prompt_logits(ids)
    assert (ours - reference).abs().max() <= 1e-3 * reference.abs().max()


@pytest.mark.parametrize("moe_model", ["deepseek_v2", "deepseek_v3"], indirect=True)
def test_long_prompt_chunks_attend_in_the_expanded_form_as_hf_does(moe_model, make_llm_for_test, monkeypatch):
    """Prompt chunks of EXPAND_MIN_TOKENS or more multiply K and V per head out of the latents and attend through
    SDPA: a 300-token prompt in chunks of 160 (the second over the first's cached rows) beside a short prompt
    decoding in the same steps, and the same in chunks of 100 (absorbed): HF's greedy choices every time."""
    from conftest import hf_greedy_disagreements
    from ridge.attention.latent import EXPAND_MIN_TOKENS, LatentBackend

    path, hf = moe_model
    calls = []
    expanded = LatentBackend.attend_expanded
    monkeypatch.setattr(LatentBackend, "attend_expanded", lambda self, layer, chunk, *rest: (
        calls.append(chunk.length), expanded(self, layer, chunk, *rest))[1])
    long, short = random_prompts(1, VOCAB, 300, 301, seed=21)[0], random_prompts(1, VOCAB, 6, 7, seed=22)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for budget in (160, 100):
        calls.clear()
        llm = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=budget)
        outs = llm.generate([short, long], params)
        for ids, out in zip([short, long], outs, strict=True):
            assert not hf_greedy_disagreements(hf, ids, out.outputs[0].token_ids)
        first = 160 - len(short)  # the long prompt's first chunk shares the step with the short prompt's
        assert sorted(set(calls)) == (sorted({first, len(long) - first}) if budget == 160 else [])
        assert all(n >= EXPAND_MIN_TOKENS for n in calls)


class _CountedLatentDecode:
    """The CPU kernels with latent_decode counting the cache bytes each call reads: every row's blocks up to its
    context length (the kernel reads no further, kernels/latent_attention.cpp), a whole block at a time."""

    def __init__(self, ops, read: list[int]) -> None:
        self._ops, self._read = ops, read

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def latent_decode(self, q, cache, block_tables, context_lens, *args, **kwargs):
        block_size, dim = cache.shape[1], cache.shape[2]
        blocks = int(((context_lens + block_size - 1) // block_size).sum())
        self._read.append(blocks * block_size * dim * cache.element_size())
        return self._ops.latent_decode(q, cache, block_tables, context_lens, *args, **kwargs)


@pytest.mark.parametrize("moe_model", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_latent_attention_decode_reads_the_latent_rows_only(moe_model, kernel, make_llm_for_test):
    """The cache rows a batch-1 decode step of DeepSeek-V3's latent attention reads, through the C++ kernel or
    torch's gather: the plan's KV bytes of its context (to whole blocks), a quarter of what K and V per head would
    be on this small config."""
    from ridge.plan.arithmetic import kv_bytes

    path, _ = moe_model
    # enforce_eager: the layers call the backend from Python, where its reads can be counted
    llm = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False, enforce_eager=True)
    engine = llm.engine
    engine.add_request(random_prompts(1, VOCAB, 158, 159, seed=8)[0],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill: 158 tokens; the next step decodes at a context of 159
    backend, read = engine.runner.backend, []
    ops, gather = backend.ops, backend.gather
    assert ops is not None and backend.kernel

    def counted(layer, table):
        rows, latents = gather(layer, table)
        read.append(rows.nbytes)  # the latents are a view of the same rows
        return rows, latents

    backend.gather = counted
    backend.ops = _CountedLatentDecode(ops, read) if kernel else None
    try:
        engine.step()
    finally:
        backend.gather, backend.ops = gather, ops
    while engine.has_unfinished:
        engine.step()
    spec, cfg = engine.loaded.spec, engine.loaded.config
    assert len(read) == cfg.num_layers
    assert sum(read) == kv_bytes(spec, "fp32", 160)  # 10 blocks of 16 rows
    assert abs(sum(read) - kv_bytes(spec, "fp32", 159)) / kv_bytes(spec, "fp32", 159) < 0.1
    # K (nope + rope dims) and V per head, as an expanded cache would hold them: 160 values a token here, not 40
    per_head = cfg.num_layers * 159 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert sum(read) < 0.3 * per_head * 4
