"""State-space models on small random configs against HF transformers: Mamba-2 (every layer a Mamba-2 mixer, no
FFN), Bamba (Mamba-2 layers beside llama attention layers with a half rotary, each with a SwiGLU FFN), Granite 4.0-H
(granitemoehybrid: Mamba-2 layers beside attention without rotary, each with a mixture of experts and a shared MLP,
Granite's scalars), LFM2 (gated short convolutions beside attention; LFM2-MoE with a sigmoid-routed mixture) and
Qwen3.5 (gated DeltaNet layers beside gated attention; Qwen3.5-MoE and Qwen3-Next with a mixture).
Logits, greedy tokens in a batch of 16 mixed lengths under chunked prefill (one prompt 3 chunks long, SSD chunks
inside each), the runtime-invariance checks (alone; a 7-token chunk budget with 3 state slots, where sequences wait
for a slot and, in the hybrids, are preempted for KV blocks and recompute their state), prefix caching from
snapshots of the state, the state and KV bytes the engine holds against the plan's, and what is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import GRANITE_SCALARS, assert_logits_match_hf, greedy_batch_checked_against_hf, random_prompts
from ridge import SamplingParams
from test_models_random import byte_tokenizer

VOCAB = 320
LFM2_LAYERS = ["conv", "full_attention", "conv", "full_attention"]
QWEN3_5_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SSM = dict(vocab_size=VOCAB, hidden_size=64, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(arch: str, **change):
    from transformers import BambaConfig, GraniteMoeHybridConfig, Lfm2Config, Lfm2MoeConfig, Mamba2Config

    if arch == "mamba2":  # 8 heads of 16 in 2 groups of B and C; SSD chunks of 16 tokens
        return Mamba2Config(**SSM, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                            expand=2, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-6)
    if arch == "granitemoehybrid":  # Granite 4.0-H: attention without rotary, experts and a shared MLP, scalars
        config = dict(SSM, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
                      num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                      mamba_d_state=16, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16,
                      position_embedding_type="nope", max_position_embeddings=512, rms_norm_eps=1e-6,
                      **GRANITE_SCALARS)
        return GraniteMoeHybridConfig(**{**config, **change})
    if arch == "lfm2_moe":  # LFM2's layers, a dense first one, then 8 experts of 32 under a sigmoid router, top 2
        return Lfm2MoeConfig(**SSM, num_hidden_layers=4, layer_types=LFM2_LAYERS, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, num_dense_layers=1, max_position_embeddings=512, norm_eps=1e-6,
                             conv_L_cache=3, **{"routed_scaling_factor": 1.5, **change})
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # gated DeltaNet layers (4 value heads over 2 key heads)
        # beside gated attention, a quarter of each head rotary; Qwen3.5-MoE and Qwen3-Next: 8 experts of 32, top 2,
        # a gated shared expert of 48
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

        config = dict(SSM, num_hidden_layers=4, layer_types=QWEN3_5_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                      linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6)
        if arch != "qwen3_5":
            config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48)
        kind = {"qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig, "qwen3_next": Qwen3NextConfig}
        return kind[arch](**{**config, **change})
    if arch in ("nemotron_h", "nemotron_h_moe"):  # blocks of one sublayer each: Mamba-2 mixers (two in a row, the
        # first then without an MLP) and attention without rotary, each with the squared-ReLU MLP after it; the
        # mixture's: 8 ungated experts of 32 under DeepSeek-V3's router, top 2, a shared expert of 48
        from transformers import NemotronHConfig

        blocks = (["mamba", "mlp", "mamba", "mamba", "mlp", "attention", "mlp", "attention", "mlp"]
                  if arch == "nemotron_h"
                  else ["mamba", "moe", "attention", "moe", "mamba", "mamba", "mlp", "attention", "moe"])
        return NemotronHConfig(**SSM, layers_block_type=blocks, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=32, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
                               ssm_state_size=16, n_groups=2, expand=2, conv_kernel=4, chunk_size=16,
                               layer_norm_epsilon=1e-6, max_position_embeddings=512, n_routed_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                               routed_scaling_factor=1.5, **change)
    if arch == "lfm2":  # short convolutions of 3 taps beside attention with q / k norms; a SwiGLU adjusted to 96 wide
        return Lfm2Config(**SSM, num_hidden_layers=4, layer_types=LFM2_LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=144, block_multiple_of=32,
                          max_position_embeddings=512, norm_eps=1e-6, conv_L_cache=3, **change)
    return BambaConfig(**SSM, num_hidden_layers=4, attn_layer_indices=[1, 3], num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                       mamba_d_state=16, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16,
                       max_position_embeddings=512, rms_norm_eps=1e-6)


@pytest.fixture(scope="module", params=["mamba2", "bamba", "granitemoehybrid", "lfm2", "lfm2_moe", "qwen3_5",
                                              "qwen3_5_moe", "nemotron_h", "nemotron_h_moe"])
def ssm_model(request, tmp_path_factory):
    return random_hf_model(request.param, tmp_path_factory)


def random_hf_model(arch: str, tmp_path_factory, **change):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **change), dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # HF starts norms at 1: make them matter
            torch.nn.init.normal_(param, 1.0, 0.3)
        if name.endswith(("dt_bias", "A_log", ".D")):  # and A, D, dt's bias at the same value for every head
            torch.nn.init.normal_(param, 0.0, 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith(("expert_bias", "e_score_correction_bias")):  # HF starts them at 0: make them move the choice
            torch.nn.init.normal_(buffer, 0.0, 0.1)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path, model


def test_logits_match_hf(ssm_model, make_llm_for_test):
    assert_logits_match_hf(make_llm_for_test, *ssm_model, VOCAB)


def test_nemotron_h_s_published_config_keys_read_as_hf_s():
    """Nemotron-H's checkpoints may say their blocks as hybrid_override_pattern ("M-MM-*-") and their Mamba-2 keys
    under older names (mamba_n_groups, mamba_d_conv, ...), which HF reads as layers_block_type and the new names: the
    same model. Blocks ridge cannot lay out (an FFN after no mixer) and experts in a latent space are refused by
    name."""
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = hf_config("nemotron_h").to_dict()
    legacy = {key: value for key, value in config.items()
              if key not in ("layers_block_type", "n_groups", "conv_kernel", "chunk_size", "use_conv_bias")}
    legacy.update(hybrid_override_pattern="M-MM-*-*-", mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16,
                  mamba_conv_bias=True)
    ours = config_from_spec(spec_from_hf_config(config, "new"))
    assert ours == config_from_spec(spec_from_hf_config(legacy, "legacy"))
    assert (ours.num_layers, ours.ssm_layers, ours.mlp_free_layers, ours.rotary_dim) == (5, (0, 1, 2), (1,), 0)
    for change, field in (({"layers_block_type": ["mlp", "mamba"]}, "layers_block_type"),
                          ({"moe_latent_size": 16}, "moe_latent_size"),
                          ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act")):
        with pytest.raises(ValueError, match=field):
            config_from_spec(spec_from_hf_config({**config, **change}, "nemotron_h"))


def test_lfm2_s_published_config_keys_read_as_hf_s():
    """LFM2's checkpoints write block_ff_dim, tie_embedding and full_attn_idxs where HF's saved config has
    intermediate_size, tie_word_embeddings and layer_types: the same shape either way (the FFN's width adjusted to
    96 as HF's model builds it)."""
    from ridge.models.spec import spec_from_hf_config

    saved = hf_config("lfm2").to_dict()
    published = {key: value for key, value in saved.items()
                 if key not in ("intermediate_size", "tie_word_embeddings", "layer_types")}
    published.update(block_ff_dim=144, tie_embedding=True, full_attn_idxs=[1, 3])
    ours = spec_from_hf_config(published, "lfm2")
    assert ours == spec_from_hf_config(saved, "lfm2")
    assert (ours.ssm_layers, ours.intermediate_size, ours.state_mixer) == ((0, 2), 96, "short_conv")


def test_qwen3_next_s_grouped_projections_match_hf(tmp_path_factory, make_llm_for_test):
    """Qwen3-Next's DeltaNet projections come as two, their rows key head by key head (its q, k, its value heads'
    v and z; their b and a): read as Qwen3.5's four, the logits are HF's."""
    path, hf = random_hf_model("qwen3_next", tmp_path_factory)
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    assert (cfg.state_mixer, cfg.ssm_layers, cfg.num_experts) == ("gated_delta", (0, 2), 8)
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)


@pytest.mark.parametrize("change", [
    {"num_local_experts": 0}, {"position_embedding_type": "rope"},
    {"num_local_experts": 0, "position_embedding_type": "rope", "layer_types": ["attention"] * 4}],
    ids=["dense", "rope", "no-mamba"])
def test_granite_4_s_other_forms_match_hf(change, tmp_path_factory, make_llm_for_test):
    """Granite 4.0-H without experts (its shared MLP the whole FFN: H-1B, H-Micro), with rotary on its attention, and
    Granite 4.0's plain transformers (Granite-4.0-Micro: the same config, every layer attention with rotary)."""
    path, hf = random_hf_model("granitemoehybrid", tmp_path_factory, **change)
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    dense, rope = "num_local_experts" in change, "position_embedding_type" in change
    assert (cfg.num_experts, cfg.rotary_dim) == (0 if dense else 8, 16 if rope else 0)
    assert cfg.ssm_layers == (() if "layer_types" in change else (0, 2))
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)


def test_greedy_tokens_match_hf_and_hold_under_the_runtime(ssm_model, make_llm_for_test):
    """48 greedy tokens of 5 prompts equal HF's, decoded in a batch of 16 mixed lengths with 32-token prefill
    chunks; alone, and with 7-token chunks and 3 state slots (Bamba: and KV blocks for one long sequence and a
    bit, so that sequences are preempted and recompute their state), the batch's tokens do not change."""
    path, hf = ssm_model
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)

    cfg = llm.engine.loaded.config
    # Bamba: and 12 KV blocks, where the longest sequence needs 10 (its state slots take at most half: 3 here)
    memory = 3 * cfg.ssm_state_bytes() + (12 * cfg.kv_bytes_per_block(torch.float32, 16) if cfg.attention_layers
                                          else 0)
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(memory), max_num_batched_tokens=7,
                              state_snapshots=0, max_num_seqs=3)  # LFM2's states are small: more would fit
    assert tight.engine.kv.states.num_slots == 3
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    if cfg.attention_layers:
        assert tight.engine.scheduler.num_preemptions > 0


def test_the_engine_holds_the_plan_s_state_and_kv(ssm_model, make_llm_for_test):
    """A sequence's recurrent state is the plan's state bytes whatever its length; a hybrid's attention layers
    hold the plan's KV bytes for its tokens."""
    from ridge.plan.arithmetic import count_parameters, kv_bytes, state_bytes

    path, hf = ssm_model
    llm = make_llm_for_test(path, dtype="float32")
    engine = llm.engine
    spec, cfg = engine.loaded.spec, engine.loaded.config
    assert engine.runner.states.bytes_per_slot == cfg.ssm_state_bytes() == state_bytes(spec)
    assert count_parameters(spec).stored == sum(p.numel() for p in hf.parameters())
    engine.add_request(random_prompts(1, VOCAB, 100, 101, seed=7)[0],
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while engine.sequences("0")[0].num_outputs < 29:
        engine.step()
    seq = engine.sequences("0")[0]
    assert seq.state_slot is not None and engine.kv.states.num_free == engine.kv.states.num_slots - 1
    per_token = cfg.kv_bytes_per_block(torch.float32, 16) // 16 if cfg.attention_layers else 0
    assert per_token * seq.num_computed == kv_bytes(spec, "fp32", seq.num_computed)
    assert (kv_bytes(spec, "fp32", seq.num_computed) > 0) == bool(cfg.attention_layers)
    while engine.has_unfinished:
        engine.step()
    assert engine.kv.states.num_free == engine.kv.states.num_slots


# not LFM2-MoE: its mixers are LFM2's, and on random weights its sigmoid router's near-ties move a few tokens to
# other experts under int8's rounding, which says nothing of the mixers (docs/notes/ssm.md)
@pytest.mark.parametrize("ssm_model", ["mamba2", "bamba", "granitemoehybrid", "lfm2"], indirect=True)
def test_quantized_weights_run_on_the_state_space_layers_too(ssm_model, make_llm_for_test):
    """The mixers' projections are quantized (int8 per channel, no calibration) on the dense layers' kernels, and
    the logits stay near the float32 model's."""
    from ridge.linear import weight_bytes

    path, hf = ssm_model
    llm = make_llm_for_test(path, dtype="float32", quantization="int8", calibration_windows=0)
    mixers = [layer.ssm for layer in llm.engine.loaded.model.layers if layer.ssm is not None]
    theirs = [m for m in hf.modules() if hasattr(m, "in_proj") and hasattr(m, "out_proj")]  # Mamba's, LFM2's
    assert len(mixers) == len(theirs) and all(  # a byte a weight (and scales), not float32's four
        weight_bytes(ours.in_proj) < 2 * hf_mixer.in_proj.weight.numel()
        and weight_bytes(ours.out_proj) < 2 * hf_mixer.out_proj.weight.numel()
        for ours, hf_mixer in zip(mixers, theirs, strict=True))
    ids = random_prompts(1, VOCAB, 30, 31, seed=4)[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = llm.engine.prompt_logits(ids)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).mean() > 0.99  # measured 0.997


@pytest.mark.parametrize("args,field", [({"speculate": "ngram"}, "speculate"),
                                        ({"quantization": "gptq"}, "quantization: gptq"),
                                        ({"kv_cache_memory": "4KiB"}, "kv_cache_memory")])
def test_what_the_engine_cannot_do_with_state_is_refused_by_name(ssm_model, make_llm_for_test, args, field):
    path, _ = ssm_model
    with pytest.raises(ValueError, match=field):
        make_llm_for_test(path, dtype="float32", **args)


@pytest.mark.parametrize("arch,change,field", [
    ("bamba", {"mlp_bias": True}, "mlp_bias"), ("bamba", {"mamba_expand": 3}, "expand"),
    ("bamba", {"mamba_n_groups": 3}, "ssm_groups"),
    ("granitemoehybrid", {"position_embedding_type": "alibi"}, "position_embedding_type: 'alibi'"),
    ("granitemoehybrid", {"layer_types": ["mamba", "conv", "mamba", "attention"]}, "layer_types"),
    ("granitemoehybrid", {"layer_types": ["mamba", "attention"]}, "layer_types"),
    ("lfm2", {"layer_types": ["conv", "sliding_attention", "conv", "full_attention"]}, "layer_types"),
    ("qwen3_5", {"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types")])
def test_a_config_ridge_does_not_implement_is_refused_by_name(arch, change, field):
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config(arch).to_dict(), **change}
    with pytest.raises(ValueError, match=field):
        config_from_spec(spec_from_hf_config(config, arch))


@pytest.mark.threaded
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conv_bias,dt_limit", [(True, (0.0, float("inf"))), (False, (0.05, 0.4))])
def test_the_c_decode_token_is_the_torch_recurrence(ops, dtype, conv_bias, dt_limit):
    """kernels/state_space.cpp's decode token (the convolution step, dt, the recurrence, D's skip) against the
    mixer's torch form: the same outputs and states within float32's rounding, on the rows' slots only (others
    untouched), for 3 sequences of 2 groups of heads, a dt clamp and a convolution without bias."""
    from ridge.kv.state_cache import StateCache, StateStep
    from ridge.models.mamba import Mamba2Mixer
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config("mamba2").to_dict(), "use_conv_bias": conv_bias, "time_step_limit": dt_limit}
    cfg = config_from_spec(spec_from_hf_config(config, "mamba2"))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg, 0)
    for param in mixer.parameters():
        torch.nn.init.normal_(param, 0.0, 0.5)
    mixer = mixer.to(dtype)
    caches = [StateCache([0], 6, cfg.ssm_conv_channels, cfg.ssm_conv_kernel, cfg.ssm_num_heads, cfg.ssm_head_dim,
                         cfg.ssm_state_size, "cpu") for _ in range(2)]
    for tensor in (caches[0].conv[0], caches[0].ssm[0]):
        tensor.normal_()
    caches[1].conv[0].copy_(caches[0].conv[0])
    caches[1].ssm[0].copy_(caches[0].ssm[0])
    before = caches[0].ssm[0].clone()
    x = torch.randn(3, cfg.hidden_size).to(dtype)
    outs = []
    for cache, kernel in zip(caches, (ops, None), strict=True):
        mixer.ops = kernel
        outs.append(mixer(x, StateStep(cache, torch.tensor([4, 1, 3]), 3, [])))
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output projection's input rounded
    assert torch.allclose(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)
    for ours, theirs in ((caches[0].conv[0], caches[1].conv[0]), (caches[0].ssm[0], caches[1].ssm[0])):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours[[0, 2, 5]], theirs[[0, 2, 5]])
    assert torch.equal(caches[0].ssm[0][[0, 2, 5]], before[[0, 2, 5]])
    assert not torch.allclose(caches[0].ssm[0][[4, 1, 3]], before[[4, 1, 3]], atol=1e-3)  # advanced


@pytest.mark.threaded  # the kernels split their work across threads: on every core
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_decode_step_serves_state_space_models_to_the_bit(ssm_model, dtype, make_llm_for_test):
    """Decode steps in one C++ call (the mixers over their state slots; Mamba-2's float32 residual stream in
    bfloat16, Bamba's attention layers with their half rotary) against every layer in Python (enforce_eager): the
    same tokens and log-probabilities to the last bit, for 5 sequences at once, with the decode's state snapshots
    taken around the stack's steps; the stack serves every step after the prompts'."""
    from conftest import assert_stack_equals_eager

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    stacked = assert_stack_equals_eager(make_llm_for_test, ssm_model[0], random_prompts(5, VOCAB, 3, 40, seed=21),
                                        params, dtype=dtype)
    assert stacked.engine.kv.snapshots  # decodes past block boundaries left snapshots


def test_a_mamba2_written_as_gguf_reads_back_as_the_same_model(smollm2_path, tmp_path, make_llm_for_test):
    """Mamba-2 under llama.cpp's names and header (bench/random_gguf.py: A itself in ssm_a, A and D as [heads, 1],
    the gated norm's weight per group; the heads in ssm.time_step_rank) loads from the file as the model ridge
    draws for the config: the same shape, logits and greedy tokens. (llama.cpp's own logits on such a file:
    docs/notes/ssm.md.)"""
    import dataclasses

    from conftest import gguf_round_trip

    config = {**hf_config("mamba2").to_dict(), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.spec, drawn.engine.loaded.spec
    assert ours.ssm_layers == (0, 1, 2) and ours.ssm_groups == 2
    assert dataclasses.replace(ours, name=theirs.name, source=theirs.source) == theirs
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in from_file.generate([ids], params)]
            == [o.outputs[0].token_ids for o in drawn.generate([ids], params)])


def test_a_bamba_is_written_as_llama_cpp_s_granitehybrid(smollm2_path, tmp_path):
    """Bamba for llama.cpp (`granitehybrid`): KV heads per layer (0 on the Mamba layers), the half rotary's width,
    rotary switched on; q and k rows interleaved over each head's rotary dims only, the rest as drawn (the form
    llama.cpp runs as HF's Bamba: its logits within 1e-4 of ridge's, docs/notes/ssm.md), and the file marked so."""
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.gguf_file import read_gguf
    from ridge.models.loader import PARTIAL_ROTARY_ROWS, random_model
    from ridge.models.presets import resolve_model
    from ridge.models.random_weights import random_spec

    (tmp_path / "config.json").write_text(json.dumps({**hf_config("bamba").to_dict(), "vocab_size": 49152}))
    spec = random_spec(f"random:{tmp_path}")
    path = write_random_gguf(spec, tmp_path / "model.gguf", smollm2_path, float16=False)
    gguf = read_gguf(path)
    assert gguf.fields["general.architecture"] == "granitehybrid"
    assert list(gguf.fields["granitehybrid.attention.head_count_kv"]) == [0, 2, 0, 2]
    assert gguf.fields["granitehybrid.rope.dimension_count"] == 8  # half of a 16-wide head
    drawn = random_model(spec, torch.float32, "cpu", 0).model.state_dict()["layers.1.attn.qkv.weight"]
    written = torch.from_numpy(next(t for t in gguf.tensors if t.name == "blk.1.attn_q.weight").data.copy())
    heads = written.view(4, 16, -1)
    drawn_heads = drawn[:64].view(4, 16, -1)
    assert torch.equal(heads[:, 8:], drawn_heads[:, 8:])  # past the rotary dims: as drawn
    assert torch.equal(heads[:, 0:8:2], drawn_heads[:, 0:4]) and torch.equal(heads[:, 1:8:2], drawn_heads[:, 4:8])
    assert "blk.0.ssm_in.weight" in {t.name for t in gguf.tensors}
    assert gguf.fields[PARTIAL_ROTARY_ROWS] and resolve_model(str(path)).partial_rotary_factor == 0.5


@pytest.mark.parametrize("layout", ["ridge", "converter"])
def test_a_bamba_gguf_reads_back_as_the_same_model(layout, smollm2_path, tmp_path, make_llm_for_test, monkeypatch):
    """A Bamba in ridge's granitehybrid form (each head's rotary rows interleaved, marked) and in llama.cpp's
    converter's (whole heads interleaved, llama's permutation, no mark) both load as the model ridge draws for the
    config: the same logits."""
    from conftest import gguf_round_trip
    from ridge.bench import random_gguf

    if layout == "converter":
        ridge_form = random_gguf._permute_rotary
        monkeypatch.setattr(random_gguf, "_permute_rotary",
                            lambda rows, heads, _: ridge_form(rows, heads, rows.shape[0] // heads))
        monkeypatch.setattr(random_gguf, "PARTIAL_ROTARY_ROWS", "test.the_converter_writes_no_mark")
    config = {**hf_config("bamba").to_dict(), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert from_file.engine.loaded.config.rotary_dim == 8
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def test_a_nemotron_h_written_as_gguf_reads_back_as_the_same_model(smollm2_path, tmp_path, make_llm_for_test):
    """Nemotron-H under llama.cpp's `nemotron_h`: its blocks as the file's layers (a Mamba-2 block where the KV head
    count and the FFN width are 0, attention where the KV head count is not, an MLP where the width is not; each
    block's norm its attn_norm, the MLP's up alone in ffn_up), and Nemotron 3's under `nemotron_h_moe` (every FFN
    block a mixture, told by its router: ungated experts, the correction bias, the shared expert), load as the
    models ridge draws for the configs; a mixture with a dense MLP block, which llama.cpp would read as a mixture, is
    refused by name rather than written."""
    import dataclasses

    from conftest import gguf_round_trip

    all_experts = ["mamba", "moe", "attention", "moe", "mamba", "mamba", "moe", "attention", "moe"]
    for name, config, shape in (
            ("dense", hf_config("nemotron_h").to_dict(), ((0, 1, 2), (1,), 0)),
            ("moe", {**hf_config("nemotron_h_moe").to_dict(), "layers_block_type": all_experts}, ((0, 2, 3), (2,), 8))):
        (tmp_path / name).mkdir()
        from_file, drawn = gguf_round_trip({**config, "vocab_size": 49152}, tmp_path / name, smollm2_path,
                                           make_llm_for_test)
        ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
        assert (ours.ssm_layers, ours.mlp_free_layers, ours.num_experts, ours.hidden_act) == (*shape, "relu2")
        # (the file says no dense FFN width where every FFN block is a mixture: no layer has one)
        unstored = {f: getattr(theirs, f) for f in ("rms_norm_eps", "ssm_chunk_size", "max_position_embeddings",
                                                    *(("intermediate_size",) if name == "moe" else ()))}
        assert dataclasses.replace(ours, **unstored) == theirs
        ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
        assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)
    (tmp_path / "mixed").mkdir()
    with pytest.raises(ValueError, match="dense layers .* in nemotron_h_moe"):
        gguf_round_trip({**hf_config("nemotron_h_moe").to_dict(), "vocab_size": 49152}, tmp_path / "mixed",
                        smollm2_path, make_llm_for_test)


@pytest.mark.parametrize("arch,change", [("granitemoehybrid", {}), ("granitemoehybrid", {"num_local_experts": 0}),
                                         ("lfm2", {}), ("lfm2_moe", {"routed_scaling_factor": 1.0}),
                                         ("qwen3_5", {"linear_value_head_dim": 16}),
                                         ("qwen3_5_moe", {"linear_value_head_dim": 16}),
                                         ("qwen3_next", {"linear_value_head_dim": 16})],
                         ids=["granite-experts", "granite-dense", "lfm2", "lfm2-moe", "qwen3.5", "qwen3.5-moe",
                              "qwen3-next"])
def test_a_hybrid_written_as_gguf_reads_back_as_the_same_model(arch, change, smollm2_path, tmp_path,
                                                               make_llm_for_test):
    """Granite 4.0-H under llama.cpp's `granitehybrid` (its Mamba layers where the per-layer KV head count is 0,
    rotary off, Granite's scalars, the experts stacked and the shared MLP as ffn_*_shexp; or, without experts, the
    shared MLP as the FFN), and LFM2 under its `lfm2` (its short convolutions where the KV head count is 0, the
    taps in shortconv.l_cache, the final norm as token_embd_norm), and Qwen3.5 under its `qwen35` / `qwen35moe`
    (attention every full_attention_interval-th layer, each head's query and gate side by side in attn_q, the
    DeltaNet's value heads in llama.cpp's tiled order, which the file's model keeps) and Qwen3-Next under its
    `qwen3next` (HF's grouped order, b and a fused key head by key head in ssm_ba), load from the file as the
    model ridge draws for the config: the same shape and logits."""
    import dataclasses

    from conftest import gguf_round_trip

    config = {**hf_config(arch, **change).to_dict(), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    dense = arch in ("lfm2", "qwen3_5") or "num_local_experts" in change
    assert ours.ssm_layers == (0, 2) and ours.num_experts == (0 if dense else 8)
    assert ours.rotary_dim == {"lfm2": 16, "lfm2_moe": 16, "qwen3_5": 8, "qwen3_5_moe": 8, "qwen3_next": 8}.get(arch, 0)
    assert ours.ssm_heads_tiled == arch.startswith("qwen3_5")
    # GGUF keeps eps in float32, and no SSD chunk size (how a prompt is scanned, not what it computes); Qwen3.5's
    # value heads in another order (the same model)
    unstored = {f: getattr(theirs, f) for f in ("rms_norm_eps", "ssm_chunk_size", "max_position_embeddings",
                                                "ssm_heads_tiled")}
    assert dataclasses.replace(ours, **unstored) == theirs
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_hf_transformers_reads_ridge_s_qwen35_files_as_the_model(arch, smollm2_path, tmp_path_factory,
                                                                 make_llm_for_test):
    """An HF model read by ridge and written as llama.cpp's qwen35 / qwen35moe (value heads tiled, each query head's
    gate beside it in attn_q, A itself, 1 + w norms) is, read back by transformers' own GGUF loader (which undoes
    llama.cpp's converter), the model it was: the same logits."""
    from transformers import AutoModelForCausalLM

    from ridge.bench.random_gguf import write_gguf

    path, hf = random_hf_model(arch, tmp_path_factory, vocab_size=49152, linear_value_head_dim=16)
    folder = tmp_path_factory.mktemp(f"{arch}-gguf")
    write_gguf(make_llm_for_test(path, dtype="float32").engine.loaded, folder / "model.gguf", smollm2_path,
               float16=False)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = torch.tensor(random_prompts(1, 49152, 30, 31, seed=6))
    with torch.inference_mode():
        assert torch.allclose(theirs(ids).logits, hf(ids).logits, atol=1e-5)


def test_a_qwen35_gguf_s_multi_token_prediction_block_is_left_out(smollm2_path, tmp_path, make_llm_for_test,
                                                                   monkeypatch):
    """llama.cpp writes Qwen3.5's multi-token prediction layer as one more block (`nextn_predict_layers` of them
    past the decoder's): ridge reads the decoder's layers and leaves the drafter's block out, the same model."""
    from conftest import gguf_round_trip
    from ridge.bench import random_gguf

    header, tensors = random_gguf._header, random_gguf._gguf_tensors

    def with_prediction_header(writer, arch, spec, *rest):
        add = writer.add_block_count
        writer.add_block_count = lambda count: add(count + 1)
        header(writer, arch, spec, *rest)
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)

    def with_prediction_block(cfg, state):
        yield from tensors(cfg, state)
        yield f"blk.{cfg.num_layers}.attn_norm.weight", torch.ones(cfg.hidden_size)
        yield f"blk.{cfg.num_layers}.nextn.eh_proj.weight", torch.ones(cfg.hidden_size, 2 * cfg.hidden_size)

    monkeypatch.setattr(random_gguf, "_header", with_prediction_header)
    monkeypatch.setattr(random_gguf, "_gguf_tensors", with_prediction_block)
    config = {**hf_config("qwen3_5", linear_value_head_dim=16).to_dict(), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert from_file.engine.loaded.config.num_layers == 4
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def fused_qkvz(tensors):
    """_gguf_tensors as llama.cpp's first qwen3next files had them: each DeltaNet's q, k, v and z in one ssm_in,
    key head by key head (HF's in_proj_qkvz), where later ones hold attn_qkv and attn_gate."""
    def write(cfg, state):
        held = {}
        for name, tensor in tensors(cfg, state):
            if not name.endswith(("attn_qkv.weight", "attn_gate.weight")):
                yield name, tensor
                continue
            held[name.split(".")[2]] = tensor
            if len(held) == 2:
                groups, keys = cfg.ssm_groups, cfg.ssm_groups * cfg.ssm_state_size
                qkv, z = held.pop("attn_qkv"), held.pop("attn_gate")
                parts = [qkv[:keys], qkv[keys:2 * keys], qkv[2 * keys:], z]
                yield (f"{name.rsplit('.', 2)[0]}.ssm_in.weight",
                       torch.cat([part.unflatten(0, (groups, -1)) for part in parts], 1).flatten(0, 1))
    return write


def test_a_qwen3next_gguf_s_fused_input_projection_reads_as_its_parts(smollm2_path, tmp_path, make_llm_for_test,
                                                                      monkeypatch):
    """A qwen3next file whose DeltaNet input projection is one ssm_in (llama.cpp's first converter's, which its
    loader still reads) loads as the same model as one holding attn_qkv and attn_gate."""
    from conftest import gguf_round_trip
    from ridge.bench import random_gguf
    from ridge.models.loader import open_gguf

    monkeypatch.setattr(random_gguf, "_gguf_tensors", fused_qkvz(random_gguf._gguf_tensors))
    config = {**hf_config("qwen3_next", linear_value_head_dim=16).to_dict(), "vocab_size": 49152}
    from_file, drawn = gguf_round_trip(config, tmp_path, smollm2_path, make_llm_for_test)
    assert "blk.0.ssm_in.weight" in {t.name for t in open_gguf(tmp_path / "model.gguf").tensors}
    ids = random_prompts(1, 49152, 20, 21, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)


def test_an_lfm2moe_gguf_with_an_expert_weight_scale_is_refused_by_name(smollm2_path, tmp_path, monkeypatch):
    """llama.cpp's lfm2moe graph scales no expert weights: a file saying otherwise is refused, not read as 1."""
    import json

    from ridge.bench import random_gguf
    from ridge.models.presets import resolve_model
    from ridge.models.random_weights import random_spec

    config = {**hf_config("lfm2_moe", routed_scaling_factor=1.0).to_dict(), "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = random_gguf._header
    monkeypatch.setattr(random_gguf, "_header", lambda writer, arch, *args: (
        header(writer, arch, *args), writer.add_expert_weights_scale(2.5)))
    path = random_gguf.write_random_gguf(random_spec(f"random:{tmp_path}"), tmp_path / "model.gguf", smollm2_path)
    with pytest.raises(ValueError, match="lfm2moe.expert_weights_scale: 2.5 is not supported"):
        resolve_model(str(path))


@pytest.mark.parametrize("arch,change,field", [("mamba2", {"time_step_limit": (0.0, 10.0)}, "ssm_dt_limit"),
                                               ("mamba2", {"use_conv_bias": False}, "ssm_conv_bias false"),
                                               ("lfm2_moe", {}, "routed_scaling_factor 1.5"),
                                               ("qwen3_5", {}, "ssm_state_size 16 != ssm_head_dim 24"),
                                               ("qwen3_5", {"layer_types": ["linear_attention", "full_attention",
                                                                            "full_attention", "linear_attention"],
                                                            "linear_value_head_dim": 16}, "full_attention_interval")])
def test_a_model_llama_cpp_would_compute_otherwise_is_not_written_as_gguf(arch, change, field, smollm2_path,
                                                                          tmp_path):
    import json

    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    (tmp_path / "config.json").write_text(json.dumps({**hf_config(arch).to_dict(), "vocab_size": 49152, **change}))
    with pytest.raises(ValueError, match=field):
        write_random_gguf(random_spec(f"random:{tmp_path}"), tmp_path / "model.gguf", smollm2_path)


def test_prefix_caching_starts_from_state_snapshots(ssm_model, make_llm_for_test):
    """Requests sharing a 70-token system prompt, one after another: the first leaves a snapshot of its state at
    its prompt's last full block, the second (another question) at the branch point, the shared 4 blocks; the
    third starts there and a repeat of the first at the first's snapshot. Every one's greedy tokens equal an
    engine's without prefix caching, alone and in one batch."""
    path, _ = ssm_model
    cached = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=48)
    plain = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False)
    system = random_prompts(1, VOCAB, 70, 71, seed=11)[0]
    prompts = [system + question for question in random_prompts(3, VOCAB, 20, 30, seed=12)]
    prompts.append(prompts[0])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outs = [cached.generate([prompt], params)[0] for prompt in prompts]
    assert [o.outputs[0].token_ids for o in outs] == reference
    first_end = (len(prompts[0]) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64, first_end]
    assert [o.outputs[0].token_ids for o in cached.generate(prompts, params)] == reference


def test_a_request_s_other_samples_resume_from_the_first_s_snapshot(ssm_model, make_llm_for_test):
    """n = 3 seeded samples: the second and third wait for the first's prompt, then start from the snapshot it left
    at its last full block; every sample's tokens equal an engine's without prefix caching."""
    path, _ = ssm_model
    prompt = random_prompts(1, VOCAB, 50, 51, seed=15)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    llm = make_llm_for_test(path, dtype="float32")
    cached = llm.generate([prompt], params)[0]
    plain = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False).generate([prompt], params)[0]
    assert [o.token_ids for o in cached.outputs] == [o.token_ids for o in plain.outputs]
    assert len({tuple(o.token_ids) for o in cached.outputs}) > 1  # three draws, not one path thrice
    assert llm.engine.kv.cache.stats.hits == 2 * 48  # the other two samples found the first's 3 blocks


def test_a_conversation_s_next_turn_starts_from_its_reply_s_snapshot(ssm_model, make_llm_for_test):
    """A reply's decode leaves a snapshot at each block boundary it reaches, each replacing the one before: the next
    turn (the first prompt, the reply, a new message) starts at the reply's last boundary, not at the first prompt's
    last full block, with an engine's tokens without prefix caching."""
    path, _ = ssm_model
    cached = make_llm_for_test(path, dtype="float32")
    plain = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False)
    first, question = random_prompts(2, VOCAB, 45, 46, seed=16)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reply = cached.generate([first], params)[0].outputs[0].token_ids
    assert reply == plain.generate([first], params)[0].outputs[0].token_ids
    assert len(cached.engine.kv.snapshots) == 2  # the prompt's last full block (32) and the reply's last (80 of 84)
    second = first + reply + question[:10]
    out = cached.generate([second], params)[0]
    assert out.num_cached_tokens == (len(first) + len(reply) - 1) // 16 * 16 == 80
    assert out.outputs[0].token_ids == plain.generate([second], params)[0].outputs[0].token_ids


def test_snapshots_hold_their_accounting_under_pressure(ssm_model, make_llm_for_test):
    """One snapshot slot and a tight pool: snapshots are evicted for newer ones, sequences are preempted while a
    snapshot of theirs is pending, and the slots' accounting holds after every step; the tokens do not change."""
    path, _ = ssm_model
    cfg_probe = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False).engine.loaded.config
    memory = 4 * cfg_probe.ssm_state_bytes() + (
        10 * cfg_probe.kv_bytes_per_block(torch.float32, 16) if cfg_probe.attention_layers else 0)
    llm = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(memory), max_num_batched_tokens=24,
                            max_num_seqs=3, state_snapshots=1)
    engine = llm.engine
    assert engine.kv.snapshots.num_slots == 1
    system = random_prompts(1, VOCAB, 40, 41, seed=13)[0]
    prompts = [system + q for q in random_prompts(6, VOCAB, 10, 60, seed=14)] * 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.samples[0].token_ids)
        engine.check_integrity()
    assert engine.kv.snapshots.evictions > 0
    if cfg_probe.attention_layers:
        assert engine.scheduler.num_preemptions > 0
    plain = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [outputs[str(i)] for i in range(len(prompts))] == reference


def test_state_snapshots_refuse_what_they_cannot_do(ssm_model, make_llm_for_test):
    from ridge.config import EngineConfig
    from ridge.engine.kv_transfer import check_transferable

    path, _ = ssm_model
    with pytest.raises(ValueError, match="state_snapshots: keeps states for prefix caching"):
        EngineConfig(model=str(path), state_snapshots=2, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="state_snapshots: must be at least 0"):
        EngineConfig(model=str(path), state_snapshots=-1)
    with pytest.raises(ValueError, match="state_snapshots: 10000000 of"):  # LFM2's are 1 KiB each
        make_llm_for_test(path, dtype="float32", state_snapshots=10_000_000)
    if not path.name.startswith("mamba2"):  # eviction runs on attention caches: the hybrids'
        with pytest.raises(ValueError, match="state_snapshots: prefix caching is off .* kv_eviction=sink-window"):
            make_llm_for_test(path, dtype="float32", state_snapshots=2, kv_eviction="sink-window", kv_budget=64)
    with pytest.raises(ValueError, match="role: disaggregated prefill moves KV blocks, not the snapshots"):
        check_transferable(make_llm_for_test(path, dtype="float32").engine)


def test_state_snapshots_on_a_model_without_state_is_refused(smollm2_path, make_llm_for_test):
    with pytest.raises(ValueError, match="state_snapshots: keeps states of state-space layers"):
        make_llm_for_test(smollm2_path, dtype="float32", state_snapshots=4)


@pytest.mark.parametrize("ssm_model", ["mamba2", "bamba"], indirect=True)  # a pure one and a hybrid
def test_bench_context_times_decode_by_context(ssm_model, tmp_path, capsys):
    """`ridge bench context` runs each model at each context and reports the bytes a step moves: a pure Mamba-2
    model's are the same at every context (weights and a fixed state), a hybrid's grow with its attention KV."""
    import json

    from ridge.cli import main

    path, _ = ssm_model
    plot = tmp_path / "context.png"
    assert main(["bench", "context", "--models", f"random:{path}", "--contexts", "16,48", "--output-len", "3",
                 "--repeats", "1", "--no-peers", "--dtype", "float32", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out.split("\nplot:")[0])["rows"]
    assert [(r["engine"], r["context"]) for r in rows] == [("ridge", 16), ("ridge", 48)]
    assert all(r["ms_per_token"] > 0 and r["read_fraction"] > 0 for r in rows)
    grows = rows[1]["step_bytes"] - rows[0]["step_bytes"]
    assert (grows > 0) == (not path.name.startswith("mamba2")) and plot.stat().st_size > 0


@pytest.mark.parametrize("ssm_model", ["mamba2"], indirect=True)
def test_mamba2_keeps_its_residual_stream_in_float32(ssm_model, make_llm_for_test):
    """residual_in_fp32 (HF's default for Mamba-2): in bfloat16 the residual stream reaches the final norm in
    float32, the sum of every layer's output in float32; each norm reads it rounded to bfloat16."""
    from ridge.models.layers import RMSNorm

    path, _ = ssm_model
    llm = make_llm_for_test(path, dtype="bfloat16")
    model = llm.engine.loaded.model
    assert llm.engine.loaded.config.residual_in_fp32
    seen = []
    hook = model.norm.register_forward_pre_hook(lambda _, args: seen.append((args[0].dtype, args[1].dtype)))
    try:
        llm.engine.prompt_logits(random_prompts(1, VOCAB, 20, 21, seed=9)[0])
    finally:
        hook.remove()
    assert seen == [(torch.bfloat16, torch.float32)]
    norm = RMSNorm(8, 1e-6).bfloat16()
    residual, x = torch.randn(3, 8), torch.randn(3, 8).bfloat16()
    expected = residual + x.float()
    out, summed = norm(x, residual.clone())
    assert torch.equal(summed, expected) and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.rms_norm(expected.bfloat16(), (8,), norm.weight, 1e-6))
