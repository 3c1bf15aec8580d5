"""Gemma 4 on small random configs against HF transformers: its global layers' wider heads and fewer KV heads (their
values the keys' projection), proportional rotary, v norms and layer scalars; the E models' per-layer embeddings,
KV sharing and double-wide MLPs. Logits in float32, greedy tokens of a batch of 16 under the runtime's checks
(32-token chunks, a pool that preempts, prefix caching off, speculation), the KV the engine holds against the plan's,
and what is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import (
    assert_awq_folding_keeps_the_model,
    assert_logits_match_hf,
    assert_stack_equals_eager,
    blocks_moved_between_engines,
    greedy_batch_checked_against_hf,
    layerwise_walk,
    linears_of_one_decode,
    random_prompts,
)
from ridge import SamplingParams
from test_models_random import saved, with_drawn_norms

VOCAB = 320
WINDOW = 8  # prompts run well past it

# the dense 31B's shape: 5 windowed layers to 1 global, the global ones' heads twice as wide, one KV head, values the
# keys' projection
DENSE = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
             num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0)
# the E models' (E2B): per-layer embeddings, the last 2 of 6 layers sharing the cache of the last earlier one of their
# kind, their MLPs twice as wide
EDGE = dict(num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True)


def hf_config(**changes):
    from transformers import Gemma4TextConfig

    config = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  hidden_size_per_layer_input=0, sliding_window=WINDOW, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Gemma4TextConfig(**{**config, **changes})


def random_hf_model(name: str, changes: dict, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = with_drawn_norms(AutoModelForCausalLM.from_config(hf_config(**changes), dtype=torch.float32).eval())
    # HF starts layer scalars and the 26B-A4B router's scales at 1 too: make them matter
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("router.scale", "router.per_expert_scale")):
                param.uniform_(0.5, 1.5)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return saved(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module", params=["dense", "edge"])
def gemma4_model(request, tmp_path_factory):
    return random_hf_model(request.param, {"dense": DENSE, "edge": EDGE}[request.param], tmp_path_factory)


def test_logits_match_hf(gemma4_model, make_llm_for_test):
    """HF's float32 logits on prompts of 5-80 tokens (past the window), on the paged and the reference backends."""
    path, hf = gemma4_model
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB, attention_backend="reference")


@pytest.mark.threaded  # the kernels split their work across threads: on every core
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_decode_step_is_the_python_path_to_the_bit(gemma4_model, make_llm_for_test, dtype):
    """Decode steps in one C++ call (each layer kind's head shape and rotary, values from keys, v norms, the
    KV-shared layers reading their sources' caches, the per-layer branch and the layer scalars) against every layer
    in Python (enforce_eager): the same tokens and log-probabilities to the last bit, prompts past the window."""
    path, _ = gemma4_model
    prompts = random_prompts(5, VOCAB, 3, 40, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    assert_stack_equals_eager(make_llm_for_test, path, prompts, params, dtype=dtype)


def test_greedy_tokens_match_hf_and_hold_under_the_runtime(gemma4_model, make_llm_for_test):
    """48 greedy tokens of 5 prompts equal HF's, decoded in a batch of 16 mixed lengths with 32-token prefill
    chunks; alone, in a pool that preempts, without the prefix cache and with n-gram speculation, the batch's
    tokens do not change; bfloat16 decodes run."""
    path, hf = gemma4_model
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    per_block = llm.engine.loaded.config.kv_bytes_per_block(torch.float32, llm.engine.config.block_size)
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(per_block * 48),
                              enable_prefix_caching=False, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    assert tight.engine.scheduler.num_preemptions > 0
    speculating = make_llm_for_test(path, dtype="float32", speculate="ngram", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts[:6], params)] == batch[:6]
    bf16 = make_llm_for_test(path, dtype="bfloat16")
    assert all(len(o.outputs[0].token_ids) == 48 for o in bf16.generate(prompts[:4], params))


def test_the_cache_holds_what_each_layer_kind_needs(gemma4_model, make_llm_for_test):
    """The cache's tensors: each windowed and global slot in its own shape (the global layers' wider heads, fewer of
    them), none for a KV-shared layer; a block id's bytes are the plan's per-block figure."""
    path, _ = gemma4_model
    llm = make_llm_for_test(path, dtype="float32")
    cfg, backend = llm.engine.loaded.config, llm.engine.runner.backend
    shared = cfg.kv_sources()
    for layer in cfg.attention_layers:
        if layer in shared:
            assert layer not in backend.k_cache
            continue
        heads, dim = (2, 16) if cfg.is_local(layer) else (1 if cfg.global_values_from_keys else 2, 32)
        assert backend.k_cache[layer].shape[0] == heads and backend.k_cache[layer].shape[2] * 2 == dim
    held = sum(rows.numel() * rows.element_size() for rows, _ in backend.block_tensors())
    assert held == backend.num_blocks * cfg.kv_bytes_per_block(torch.float32, backend.block_size)


def test_kv_shared_layers_read_their_source_layers_cache(tmp_path_factory, make_llm_for_test):
    """The E config's layers 4 (windowed) and 5 (global) share the caches of layers 3 and 2, the last earlier
    layers of their kinds (HF's kv_sharing_modes): the engine holds cache for 4 layers, and a 40-token prompt's
    logits are HF's."""
    path, hf = random_hf_model("edge-sharing", EDGE, tmp_path_factory)
    llm = make_llm_for_test(path, dtype="float32")
    cfg = llm.engine.loaded.config
    assert cfg.kv_sources() == {4: 3, 5: 2} and cfg.kv_layers == [0, 1, 2, 3]
    ids = random_prompts(1, VOCAB, 40, 41, seed=6)[0]
    ours = llm.engine.prompt_logits(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("changes, field", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"per_layer_config": {"5": {"head_dim": 32}, "2": {"head_dim": 64}}}, "per_layer_config"),
])
def test_what_ridge_does_not_run_is_refused_by_name(changes, field, tmp_path):
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config(**DENSE).to_dict(), **changes}
    if field == "per_layer_config":
        config["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match=field):
        spec_from_hf_config(config, "gemma4")


# head dims the quantized cache's decode kernel reads (multiples of 64)
WIDE = dict(head_dim=64, global_head_dim=128)


@pytest.fixture(scope="module", params=["dense", "edge"])
def gemma4_wide(request, tmp_path_factory):
    return random_hf_model(f"{request.param}-wide", {**{"dense": DENSE, "edge": EDGE}[request.param], **WIDE},
                           tmp_path_factory)


@pytest.mark.threaded  # the kernels split their work across threads: on every core
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_a_quantized_cache_s_fused_decode_step_is_the_python_path_to_the_bit(gemma4_wide, make_llm_for_test,
                                                                             kv_cache_dtype):
    """Each layer kind's codes and scales are views of its slots' bytes: decode steps in one C++ call (the writes
    and the decode kernel over the views' strides, a KV-shared layer reading its source's codes and scales) give
    the Python path's tokens and log-probabilities to the last bit."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("the quantized cache's kernels need AVX512 (the torch path serves elsewhere, without the stack)")
    path, _ = gemma4_wide
    prompts = random_prompts(5, VOCAB, 3, 40, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    assert_stack_equals_eager(make_llm_for_test, path, prompts, params, dtype="bfloat16",
                              kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int2"])
def test_a_quantized_cache_holds_the_bytes_it_counts_and_batches_as_alone(gemma4_wide, make_llm_for_test,
                                                                          kv_cache_dtype):
    """The engine holds the bytes it counted (every layer's codes and scales in its slots' rows; int2's tails of
    each layer's own shape), and 12 prompts' greedy tokens in one batch are each prompt's alone (prefilled whole: a
    chunk that continues a cached context reads it rounded, and int8's block scales grow with the chunks, so
    chunked prompts may part at near-ties)."""
    path, _ = gemma4_wide
    llm = make_llm_for_test(path, dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                            max_num_batched_tokens=1024)
    cfg, backend, fmt = llm.engine.loaded.config, llm.engine.runner.backend, llm.engine.config.kv_format
    per_block = cfg.kv_bytes_per_block(torch.float32, backend.block_size, fmt)
    assert sum(rows.nbytes for rows in backend.slot_rows) == backend.num_blocks * per_block
    tails = sum(t.nbytes for caches in (backend.k_tails, backend.v_tails) for t in caches.values())
    assert tails == (llm.engine.kv.states.num_slots * cfg.kv_tail_bytes(torch.float32, backend.block_size)
                     if fmt.tail else 0)
    prompts = random_prompts(12, VOCAB, 3, 60, seed=4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts[:4]] == batch[:4]


def test_a_quantized_cache_on_cuda_is_refused_by_name(gemma4_wide):
    """Its Triton kernels take strides, but no GPU has run them over the slots' views: refused before anything is
    allocated."""
    from ridge.attention import make_backend
    from ridge.kv.formats import kv_format
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    cfg = config_from_spec(spec_from_hf_config(json.loads((gemma4_wide[0] / "config.json").read_text()), "gemma4"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype: int8 is not supported with .*\(Gemma 4\) on CUDA"):
        make_backend(cfg, "paged", 4, 16, torch.bfloat16, "cuda", kv_format("int8"))


def test_a_quantized_cache_preempts_and_gives_every_block_back(gemma4_wide, make_llm_for_test):
    """An int8 cache of 32 blocks for 12 prompts in 32-token chunks: sequences are preempted and recomputed, each
    finishes its 32 tokens, and every block comes back (make_llm_for_test's accounting)."""
    path, _ = gemma4_wide
    probe = make_llm_for_test(path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory="1MiB")
    per_block = probe.engine.loaded.config.kv_bytes_per_block(torch.float32, 16, probe.engine.config.kv_format)
    tight = make_llm_for_test(path, dtype="float32", kv_cache_dtype="int8", enable_prefix_caching=False,
                              max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=str(per_block * 32))
    outs = tight.generate(random_prompts(12, VOCAB, 3, 60, seed=4),
                          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert tight.engine.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)


def test_two_ranks_give_one_process_s_tokens(gemma4_model, make_llm_for_test):
    """Each layer kind's heads split on their own (the dense model's one global KV head on both ranks, its heads
    twice as wide; values the keys' projection), each rank's slots packing its share of both kinds, the KV-shared
    layers reading their source's share, the per-layer table cut by rows of the vocabulary as the embedding is:
    greedy tokens of three prompts past the window over two ranks equal one process's. Moving those packed slots
    to another engine is refused by name."""
    path, _ = gemma4_model
    prompts = random_prompts(3, VOCAB, 5, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in make_llm_for_test(path, dtype="float32").generate(prompts, params)]
    tp = make_llm_for_test(path, dtype="float32", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == one
    from ridge.engine.kv_transfer import export_prefix

    with pytest.raises(ValueError, match="moving its blocks between engines is supported on one process only"):
        export_prefix(tp.engine, prompts[0], None)
    tp.engine.close()


def test_a_quantized_cache_over_two_ranks_gives_one_process_s_tokens(gemma4_wide, make_llm_for_test):
    """An int8 cache over two ranks: each rank carves its share of both layer kinds' codes and scales from its own
    slots; greedy tokens of three prompts equal one process's."""
    path, _ = gemma4_wide
    prompts = random_prompts(3, VOCAB, 5, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = make_llm_for_test(path, dtype="float32", kv_cache_dtype="int8").generate(prompts, params)
    tp = make_llm_for_test(path, dtype="float32", kv_cache_dtype="int8", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == [o.outputs[0].token_ids for o in one]
    tp.engine.close()


def test_tensor_parallelism_refuses_uneven_query_splits_by_name(gemma4_model):
    """Rank counts that would give a rank other query heads in the global layers than in the windowed ones."""
    import dataclasses

    from ridge.cluster.shards import ShardPlan
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    cfg = config_from_spec(spec_from_hf_config(json.loads((gemma4_model[0] / "config.json").read_text()), "gemma4"))
    ShardPlan(cfg, rank=0, world=2)  # cuts
    uneven = dataclasses.replace(cfg, num_heads=6, num_kv_heads=3, global_kv_heads=2)  # q 2 | 4 against 3 | 3
    with pytest.raises(ValueError, match="split the query heads of the windowed layers .* differently"):
        ShardPlan(uneven, rank=0, world=2)


def test_config_json_with_global_head_keys_reads_as_hf_does(tmp_path):
    """A config.json as Google's (global_head_dim, num_global_key_value_heads, no per_layer_config) reads as HF's
    own saved form does."""
    from ridge.models.spec import spec_from_hf_config

    saved = hf_config(**DENSE).to_dict()
    google = {key: value for key, value in saved.items() if key != "per_layer_config"}
    google.update(global_head_dim=32, num_global_key_value_heads=1)
    a, b = spec_from_hf_config(saved, "saved"), spec_from_hf_config(json.loads(json.dumps(google)), "google")
    assert (a.global_head_dim, a.global_kv_heads) == (b.global_head_dim, b.global_kv_heads) == (32, 1)
    assert a.global_rotary_fraction == b.global_rotary_fraction == 0.25


def test_sampling_runs_on_every_layer_kind(gemma4_model, make_llm_for_test):
    """Seeded sampling gives the same tokens twice (the per-layer embeddings and shared caches hold no state
    between steps)."""
    path, _ = gemma4_model
    llm = make_llm_for_test(path, dtype="float32")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    prompts = random_prompts(3, VOCAB, 10, 30, seed=7)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("preset, global_fill, windowed_fills", [
    ("gemma-4-31b", 1.0, [1.0] * 10), ("gemma-4-e2b", 1.0, [1.0] * 2), ("gemma-4-e4b", 1.0, [1.0, 1.0, 0.5]),
    ("gemma-4-26b-a4b", 5 / 6, [1.0] * 8 + [1 / 3])])
def test_each_group_fills_the_block_ids_it_holds(preset, global_fill, windowed_fills):
    """The published shapes' layers pack whole into the cache's slots (kv/layout.py): 31B's and 26B-A4B's global
    layers, half as wide as their windowed ones, two to a slot; the E models' windowed ones, half as wide as their
    global ones, two to a slot. The global groups, which hold a long context's blocks, fill their block ids (26B-A4B's
    5 global layers 5/6 of the 3 slots they need), and a windowed group's shortfall is at most a window's worth; where
    every group fills, a token in every group costs what the plan counts per token."""
    from ridge.models.presets import model_presets
    from ridge.models.registry import config_from_spec
    from ridge.plan.arithmetic import kv_bytes_per_token

    spec = model_presets()[preset]
    cfg = config_from_spec(spec)
    layout, block = cfg.kv_layout(), 16
    per_block = cfg.kv_bytes_per_block(torch.bfloat16, block)

    def fill(group) -> float:
        return sum(2 * block * heads * dim * 2 for heads, dim in (layout.shapes[i] for i in group.layers)) / per_block

    assert [fill(g) for g in layout.groups if g.window is None] == [pytest.approx(global_fill)]
    assert [fill(g) for g in layout.groups if g.window is not None] == pytest.approx(windowed_fills)
    if global_fill == 1.0 and set(windowed_fills) == {1.0}:
        assert len(layout.groups) * per_block / block == kv_bytes_per_token(spec, "bf16")


def test_kv_shared_layers_run_only_the_rows_whose_logits_are_read(tmp_path_factory, make_llm_for_test):
    """The KV-shared layers write nothing, so a prompt's tokens whose logits nobody reads skip them (as HF's generate
    skips them): a 40-token prompt in 16-token chunks runs 16, 16 and 8 rows through a caching layer, and the last
    chunk's one row (then each decode's) through a shared one; the greedy tokens are HF's."""
    from conftest import hf_greedy_disagreements

    path, hf = random_hf_model("edge-rows", EDGE, tmp_path_factory)
    # the hooks count the Python path's rows: its decode steps too, which the fused C++ step would take
    llm = make_llm_for_test(path, dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
    rows: dict[int, list[int]] = {3: [], 4: []}
    model = llm.engine.runner.model
    for layer in rows:
        model.layers[layer].attn.register_forward_pre_hook(lambda m, args: rows[m.layer_index].append(len(args[0])))
    ids = random_prompts(1, VOCAB, 40, 41, seed=8)[0]
    (out,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert not hf_greedy_disagreements(hf, ids, out.outputs[0].token_ids)
    assert rows[3] == [16, 16, 8] + [1] * 7 and rows[4] == [1] * 8


MOE = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
           num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=8,
           top_k_experts=2, moe_intermediate_size=32)


def test_the_fused_step_refuses_layers_of_their_own_shape_outside_gemma4_attention(gemma4_model, make_llm_for_test,
                                                                                     caplog, monkeypatch):
    """Only Gemma 4's form of attention reads a layer's own head shape in the fused step: a layer of another width
    whose attention took the common form would be computed at the stack's width, so the step refuses the model."""
    from ridge.kernels import decode_stack
    from ridge.models.layers import Attention

    llm = make_llm_for_test(gemma4_model[0], dtype="float32")
    runner = llm.engine.runner
    assert decode_stack.build(runner.model, runner.backend, runner.backend.ops) is not None
    monkeypatch.setattr(Attention, "gemma4", property(lambda attn: attn.layer_index != 0))
    with caplog.at_level("WARNING", logger="ridge"):
        assert decode_stack.build(runner.model, runner.backend, runner.backend.ops) is None
    assert "layers of different head widths outside Gemma 4's attention" in caplog.text


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    return random_hf_model("moe", MOE, tmp_path_factory)


def test_the_26b_mixture_beside_the_mlp_matches_hf(gemma4_moe, make_llm_for_test):
    """The 26B-A4B's layers (8 experts, top 2, beside each layer's dense MLP; its router's own input norm and per-
    expert scales drawn away from 1): HF's float32 logits, greedy tokens of a batch under 32-token chunks, and a
    decode reading the 2 chosen experts of a layer, not all 8."""
    path, hf = gemma4_moe
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)
    greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    from ridge.plan.arithmetic import count_parameters, decode_weight_bytes

    # the hooks see the Python path's modules, which the fused C++ step would bypass
    engine = make_llm_for_test(path, dtype="float32", enforce_eager=True).engine
    touched = linears_of_one_decode(engine, random_prompts(1, VOCAB, 20, 21, seed=6)[0])
    model = engine.loaded.model
    for layer in model.layers:
        assert sum(expert.gate_up in touched for expert in layer.mlp.moe.experts) == 2
    read = sum(m.weight.numel() * 4 for m in touched)
    if model.output_projection is None:  # the head multiplies by the weight itself (no module to hook)
        read += model.output_weight.numel() * 4
    spec = engine.loaded.spec
    planned = decode_weight_bytes(spec, "fp32", batch=1) - count_parameters(spec).norms * 2
    assert abs(read - planned) / planned < 0.02, (read, planned)


@pytest.mark.threaded  # the kernels split their work across threads: on every core
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_decode_step_runs_the_26b_mixture_as_the_python_path(gemma4_moe, make_llm_for_test, dtype):
    """The 26B-A4B's layers in one C++ call (its GeGLU experts routed on the stream's own norm and scales, beside the
    dense MLP, each output normed) against every layer in Python: the same tokens and log-probabilities to the bit."""
    prompts = random_prompts(5, VOCAB, 3, 40, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    assert_stack_equals_eager(make_llm_for_test, gemma4_moe[0], prompts, params, dtype=dtype)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-cut", "experts-whole"])
def test_the_26b_mixture_over_two_ranks_gives_one_process_s_tokens(gemma4_moe, make_llm_for_test, expert_parallel):
    """The dense MLP cut by width beside the experts, each expert cut by width or each rank holding half of them
    whole: each branch summed over the ranks before its own norm (the fused C++ step's and the Python path's), the
    same greedy tokens as one process."""
    path = gemma4_moe[0]
    prompts = random_prompts(3, VOCAB, 5, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in make_llm_for_test(path, dtype="float32").generate(prompts, params)]
    tp = make_llm_for_test(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert tp.engine.runner.local.decode_stack is not None  # decode steps in C++, its all-reduces between
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == one
    tp.engine.close()


# the E config as llama.cpp's gemma4 runs it: the last two caching layers windowed, then global
EDGE_GGUF = {**EDGE, "num_kv_shared_layers": 3}


@pytest.mark.parametrize("name, changes", [("edge", EDGE_GGUF), ("moe", MOE)])
def test_round_trips_through_llama_cpps_gguf(name, changes, smollm2_path, tmp_path_factory, make_llm_for_test):
    """A Gemma 4 written as llama.cpp's gemma4 GGUF (bench/random_gguf.py: the global heads under the plain keys,
    the windowed ones' under _swa, KV heads and FFN widths per layer, the still rotary pairs as rope_freqs, the
    experts stacked) reads back as the model HF computes: its norms, scalars and router scales drawn away from 1, so
    that a tensor in another's place shows; the E model's file decodes the same tokens over two ranks."""
    from ridge.bench.random_gguf import write_gguf

    big = {**changes, "vocab_size": 49152, "vocab_size_per_layer_input": 49152}  # the vocabulary's, SmolLM2's
    path, hf = random_hf_model(f"{name}-gguf", big, tmp_path_factory)
    loaded = make_llm_for_test(path, dtype="float32").engine.loaded
    gguf = write_gguf(loaded, path / "model.gguf", smollm2_path, float16=False)
    from_file = make_llm_for_test(gguf, dtype="float32")
    ours = from_file.engine.loaded.config
    assert dataclasses.replace(ours, rms_norm_eps=loaded.config.rms_norm_eps) == loaded.config  # (a float32 there)
    ids = random_prompts(1, 49152, 40, 41, seed=9)[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (from_file.engine.prompt_logits(ids) - ref).abs().max() < 1e-4 * ref.abs().max()
    if name == "edge":  # each rank reading its rows of the file's per-layer table, padded as the embedding's
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        one = from_file.generate([ids], params)[0].outputs[0].token_ids
        tp = make_llm_for_test(gguf, dtype="float32", tensor_parallel_size=2)
        assert tp.generate([ids], params)[0].outputs[0].token_ids == one
        tp.engine.close()


def test_a_gguf_llama_cpp_would_misread_is_refused_by_name(tmp_path):
    """llama.cpp's gemma4 gives KV-shared layers the cache of the last layer before them (global) and the one before
    that (windowed): a model whose last caching layers are otherwise (the E config's: 3 windowed, then 2 global) is
    not written as a file llama.cpp would run with other caches."""
    from ridge.bench.random_gguf import write_random_gguf
    from ridge.models.random_weights import random_spec

    (tmp_path / "config.json").write_text(json.dumps(hf_config(**EDGE).to_dict()))
    with pytest.raises(ValueError, match="KV-shared layers the cache of the last layer before them"):
        write_random_gguf(random_spec(f"random:{tmp_path}"), tmp_path / "model.gguf", tmp_path / "unused.gguf")


@pytest.mark.parametrize("carry_quantized", [True, False], ids=["gptq-order", "awq-order"])
def test_layer_by_layer_calibration_carries_per_layer_inputs_and_shared_kv(tmp_path_factory, make_llm_for_test,
                                                                         carry_quantized):
    """GPTQ's walk over an E model, a layer at a time: each layer takes its slice of the per-layer inputs, and the
    KV-shared layers their source layer's k, v (as quantized, where the walk carries the quantized layers on): every
    layer's X^T X is that of one whole pass of the model, quantized in GPTQ's order, in full precision in AWQ's.
    GPTQ at load then serves the model."""
    # per-layer inputs 32 wide (E2B's 256), which int4's groups divide
    path, _ = random_hf_model("edge-gptq", {**EDGE, "hidden_size_per_layer_input": 32}, tmp_path_factory)
    llm = make_llm_for_test(path, dtype="float32")
    seen, float_hessians, quantized_hessians = layerwise_walk(llm.engine.loaded.model,
                                                              random_prompts(2, VOCAB, 64, 65, seed=3), carry_quantized)
    # a layer's linears are fitted on that layer in full precision: in GPTQ's order each later layer's first one
    # (qkv) sees the quantized layers before it; in AWQ's every linear sees the float model's inputs
    expected = {key: quantized_hessians[key] if carry_quantized and key.endswith("attn.qkv")
                and not key.startswith("layers.0.") else float_hessians[key]
                for key in seen if not carry_quantized or key.startswith("layers.0.") or key.endswith("attn.qkv")}
    bad = [key for key in expected if not torch.allclose(seen[key], expected[key], rtol=1e-5, atol=1e-5)]
    assert not bad, bad
    # the check can fail: the KV-shared layers' attention outputs differ between the two passes
    shared = [f"layers.{i}.attn.o_proj" for i in llm.engine.loaded.config.kv_sources()]
    assert shared and all(not torch.allclose(float_hessians[key], quantized_hessians[key], rtol=1e-3)
                          for key in shared)
    gptq = make_llm_for_test(path, dtype="float32", quantization="gptq", calibration_windows=2)
    assert len(gptq.generate(random_prompts(1, VOCAB, 10, 11)[0], SamplingParams(max_tokens=4))[0].outputs[0]
               .token_ids) == 4


def test_awq_s_folded_scales_keep_the_model_and_awq_serves_it(tmp_path_factory, make_llm_for_test):
    """AWQ on an E model: each layer's scales searched (its sandwich norms in the search as in the layer: the MLP's
    input is attention's output normed; the KV-shared layers' attention on their source's k, v; o_proj's scales
    kept out of the v rows, which are normed or are the keys) and folded into the norms and rows before the linears
    leave the float model's logits as they were. AWQ at load then serves the model."""
    path, _ = random_hf_model("edge-awq", {**EDGE, "hidden_size_per_layer_input": 32}, tmp_path_factory)
    llm = make_llm_for_test(path, dtype="float32")
    assert_awq_folding_keeps_the_model(llm, random_prompts(2, VOCAB, 64, 65, seed=3),
                                       random_prompts(1, VOCAB, 30, 31, seed=4)[0])
    awq = make_llm_for_test(path, dtype="float32", quantization="awq", calibration_windows=2)
    assert len(awq.generate(random_prompts(1, VOCAB, 10, 11)[0], SamplingParams(max_tokens=4))[0].outputs[0]
               .token_ids) == 4


def test_the_slots_rows_move_with_the_blocks_to_another_engine(tmp_path_factory, make_llm_for_test):
    """A prompt's blocks (the slots' rows, which every layer of any shape views its part of), exported from one engine
    and imported into another, give the tokens the first engine decodes itself."""
    path, _ = random_hf_model("edge-transfer", EDGE, tmp_path_factory)
    prefill, _, blocks, taken = blocks_moved_between_engines(make_llm_for_test, path, VOCAB)
    assert len(blocks.data) == len(prefill.engine.runner.backend.slot_rows)
    assert taken == sum(len(group) for group in blocks.groups) > 0  # every group's


def test_a_quantized_cache_s_blocks_move_to_another_engine(gemma4_wide, make_llm_for_test):
    """int8 blocks (the slots' bytes: every layer's codes and scales) exported from one engine and imported into
    another decode to the tokens of the first engine's own run over its cached prefix (a prefix hit reads the
    prompt's K and V as codes, where a cold prefill attends to them whole)."""
    from ridge.engine.kv_transfer import export_prefix, import_prefix

    path, _ = gemma4_wide
    common = {"dtype": "float32", "kv_cache_memory": "8MiB", "kv_cache_dtype": "int8"}
    prefill, decode = make_llm_for_test(path, **common), make_llm_for_test(path, **common)
    (prompt,) = random_prompts(1, VOCAB, 50, 60, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prefill.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    blocks = export_prefix(prefill.engine, prompt, None)
    assert len(blocks.data) == len(prefill.engine.runner.backend.slot_rows)
    assert import_prefix(decode.engine, blocks) == sum(len(group) for group in blocks.groups) > 0
    (out,) = decode.generate(prompt, params)
    (warm,) = prefill.generate(prompt, params)
    assert out.num_cached_tokens == warm.num_cached_tokens > 0
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids
