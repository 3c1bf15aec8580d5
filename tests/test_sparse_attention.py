"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: models/sparse_index.py) on small random configs against HF
transformers, with an indexer that keeps 16 keys, so that most of the prompts' queries attend to a choice of their
context: logits, greedy tokens of a batch of 16 (decoding well past 16 tokens of context) under the runtime's checks
(alone, 32-token chunks, a pool that preempts, prefix caching on and off, speculation), the rows a decode reads and
the KV the engine holds against the plan's, the blocks moved to another engine, and what is refused by name."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import (
    assert_logits_match_hf,
    blocks_moved_between_engines,
    greedy_batch_checked_against_hf,
    random_prompts,
)
from ridge import SamplingParams
from test_models_random import saved

VOCAB = 320
TOPK = 16


def hf_config(arch: str, **changes):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    # DeepSeek-V3's latent attention, router (within 2 groups), shared expert and dense first layer, beside an
    # indexer of 8 heads of 16 dims, the first 8 of them rotary (in halves for V3.2, interleaved pairs for GLM-5)
    config = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, intermediate_size=96, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                  routed_scaling_factor=2.5, index_topk=TOPK, index_head_dim=16, index_n_heads=8)
    return {"deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig}[arch](**{**config, **changes})


def random_hf_model(arch: str, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
    for name, param in model.named_parameters():  # HF starts norms at 1 and 0: make them matter
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(param, 1.0, 0.3)
        elif name.endswith("norm.bias"):  # the indexer's key LayerNorm
            torch.nn.init.normal_(param, 0.0, 0.3)
    for name, tensor in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            torch.nn.init.normal_(tensor, 0.0, 0.1)
    return saved(model, tmp_path_factory.mktemp(arch))


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def sparse_model(request, tmp_path_factory):
    return random_hf_model(request.param, tmp_path_factory)


def test_logits_match_hf_and_the_choice_of_keys_matters(sparse_model, make_llm_for_test):
    """HF's logits within float32 noise on prompts of 5-80 tokens; the same model attending to every key (the
    indexer's choice widened past the context) gives other logits, so the match is the choice's."""
    path, hf = sparse_model
    assert_logits_match_hf(make_llm_for_test, path, hf, VOCAB)
    ids = random_prompts(1, VOCAB, 70, 71, seed=4)[0]
    with torch.inference_mode():
        sparse = hf(torch.tensor([ids])).logits[0]
        indexers = [layer.self_attn.indexer for layer in hf.model.layers]
        for indexer in indexers:
            indexer.index_topk = 4096
        dense = hf(torch.tensor([ids])).logits[0]
        for indexer in indexers:
            indexer.index_topk = TOPK
    assert (sparse - dense).abs().max() > 0.1 * dense.abs().max()


def test_greedy_tokens_match_hf_and_hold_under_the_runtime(sparse_model, make_llm_for_test):
    """48 greedy tokens of 5 prompts equal HF's, decoded in a batch of 16 mixed lengths with 32-token prefill
    chunks; alone, in a pool that preempts, without the prefix cache and with n-gram speculation (whose drafts the
    indexer scores as a chunk's queries), the batch's tokens do not change."""
    path, hf = sparse_model
    llm, prompts, params, batch = greedy_batch_checked_against_hf(make_llm_for_test, path, hf, VOCAB)
    cfg = llm.engine.loaded.config
    row = cfg.head_dim + cfg.index_head_dim  # a token's latent row and indexer key
    tight = make_llm_for_test(path, dtype="float32", kv_cache_memory=str(cfg.num_layers * row * 4 * 224),
                              enable_prefix_caching=False, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == batch
    assert tight.engine.scheduler.num_preemptions > 0
    speculating = make_llm_for_test(path, dtype="float32", speculate="ngram", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts[:6], params)] == batch[:6]


@pytest.mark.threaded
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_decode_step_serves_contexts_up_to_the_top_k(sparse_model, dtype, make_llm_for_test, caplog,
                                                                monkeypatch):
    """The C++ decode step writes the indexer's keys and serves the decodes whose tables hold no more than top-k
    (32 here: two blocks) tokens, where attention reads every key; past it the Python path makes the choice, as the
    model's load says at warning level. A batch of 6 whose contexts cross 32 mid-generation gives the Python path's
    (enforce_eager) tokens and log-probabilities to the last bit, and both kinds of step ran."""
    import json

    from conftest import assert_stack_equals_eager
    from ridge.kernels.decode_stack import DecodeStack

    path, _ = sparse_model
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "index_topk": 32}))
    served = {True: 0, False: 0}
    serves = DecodeStack.serves

    def counted(self, step, states):
        answer = serves(self, step, states)
        served[answer] += 1
        return answer

    monkeypatch.setattr(DecodeStack, "serves", counted)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    try:
        with caplog.at_level(logging.WARNING, logger="ridge"):
            assert_stack_equals_eager(make_llm_for_test, path, random_prompts(6, VOCAB, 3, 30, seed=5), params,
                                      serves_every_decode=False, dtype=dtype)
    finally:
        (path / "config.json").write_text(json.dumps(config))
    assert served[True] and served[False]
    assert "pass sparse attention's top 32 keys" in caplog.text


@pytest.mark.parametrize("sparse_model", ["deepseek_v32"], indirect=True)
def test_a_decode_reads_every_indexer_key_and_the_chosen_rows_only(sparse_model, make_llm_for_test, monkeypatch):
    """A decode step's reads of the cache, counted where the backend gathers them: in every layer, the indexer keys
    of its table's blocks and TOPK latent rows, which is the plan's kv_read_bytes at that many tokens; and the KV
    the engine holds per token is the plan's (a latent row and an indexer key a layer)."""
    from ridge.attention.latent import LatentBackend
    from ridge.plan.arithmetic import kv_bytes, kv_read_bytes

    path, _ = sparse_model
    read: list[int] = []
    gather_keys, decode_selected = LatentBackend.gather_index_keys, LatentBackend.decode_selected

    def counted_keys(self, layer, block_table):
        keys = gather_keys(self, layer, block_table)
        if block_table.dim() == 2:  # the decodes' tables (a chunk's is one table)
            read.append(keys[0].numel() * keys.element_size())
        return keys

    def counted_rows(self, layer, q, meta, selection):
        read.append(int(selection.decode_valid[0].sum()) * self.head_dim * 4)
        return decode_selected(self, layer, q, meta, selection)

    monkeypatch.setattr(LatentBackend, "gather_index_keys", counted_keys)
    monkeypatch.setattr(LatentBackend, "decode_selected", counted_rows)
    llm = make_llm_for_test(path, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(random_prompts(1, VOCAB, 63, 64, seed=7)[0],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt
    read.clear()
    engine.step()  # one decode at 64 tokens of context: 4 whole blocks
    spec, layers = engine.loaded.spec, engine.loaded.config.num_layers
    assert len(read) == 2 * layers and sum(read) == kv_read_bytes(spec, "fp32", 64)
    assert kv_read_bytes(spec, "fp32", 64) < 0.6 * kv_bytes(spec, "fp32", 64)  # the rows not chosen: not read
    seq = engine.sequences("0")[0]
    per_token = engine.loaded.config.kv_bytes_per_block(torch.float32, engine.config.block_size) \
        // engine.config.block_size
    assert per_token * seq.num_computed == kv_bytes(spec, "fp32", seq.num_computed)
    while engine.has_unfinished:
        engine.step()


@pytest.mark.parametrize("sparse_model", ["glm_moe_dsa"], indirect=True)
def test_the_indexer_keys_move_with_the_blocks_to_another_engine(sparse_model, make_llm_for_test):
    """A prompt's blocks, latent rows and indexer keys, exported from one engine and imported into another, give the
    tokens the first engine decodes itself."""
    path, _ = sparse_model
    prefill, prompt, blocks, taken = blocks_moved_between_engines(make_llm_for_test, path, VOCAB)
    assert len(blocks.data) == 2 * prefill.engine.loaded.config.num_layers  # rows and keys, per layer
    assert taken == blocks.num_blocks == len(prompt) // 16


def test_what_ridge_does_not_run_is_refused_by_name(tmp_path_factory, make_llm_for_test):
    """GLM-5's layers that reuse another layer's choice of keys, an indexer on a family without sparse attention,
    and KV eviction beside the indexer's own choice: refused by name."""
    from ridge.models.registry import config_from_spec
    from ridge.models.spec import spec_from_hf_config

    glm = hf_config("glm_moe_dsa").to_dict()
    with pytest.raises(ValueError, match="indexer_types"):
        spec_from_hf_config({**glm, "indexer_types": ["full", "shared", "full"]}, "glm-5")
    with pytest.raises(ValueError, match="indexer_types"):
        spec_from_hf_config({**glm, "indexer_types": None, "index_topk_freq": 2}, "glm-5")
    deepseek_v3 = {**hf_config("deepseek_v32").to_dict(), "architectures": ["DeepseekV3ForCausalLM"],
                   "model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="index_topk"):
        config_from_spec(spec_from_hf_config(deepseek_v3, "deepseek-v3"))
    path, _ = random_hf_model("deepseek_v32", tmp_path_factory)
    with pytest.raises(ValueError, match="kv_eviction"):
        make_llm_for_test(path, dtype="float32", kv_eviction="sink-window", kv_budget=64)


def test_glm_5_round_trips_through_gguf(smollm2_path, tmp_path, make_llm_for_test):
    """GLM-5 written as llama.cpp's glm-dsa (the indexer's keys and heads in its header, its rotary rows back in
    interleaved pairs) reads back as the model ridge draws: the same config, and the same logits over a prompt whose
    queries attend to a choice of their keys; an indexer key llama.cpp cannot rotate is refused by name."""
    import dataclasses

    from conftest import gguf_round_trip

    config = {**hf_config("glm_moe_dsa", index_head_dim=64).to_dict(), "vocab_size": 49152}
    (tmp_path / "glm").mkdir()
    from_file, drawn = gguf_round_trip(config, tmp_path / "glm", smollm2_path, make_llm_for_test)
    ours, theirs = from_file.engine.loaded.config, drawn.engine.loaded.config
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs  # (a float32 in the header)
    assert (ours.index_topk, ours.index_heads, ours.index_head_dim) == (TOPK, 8, 64)
    ids = random_prompts(1, 49152, 60, 61, seed=5)[0]
    assert torch.allclose(from_file.engine.prompt_logits(ids), drawn.engine.prompt_logits(ids), atol=1e-5)
    (tmp_path / "narrow").mkdir()  # indexer keys llama.cpp's glm-dsa does not run: refused, not written
    with pytest.raises(ValueError, match="index_head_dim 16"):
        gguf_round_trip({**config, "index_head_dim": 16}, tmp_path / "narrow", smollm2_path, make_llm_for_test)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_the_deepseek_v3_family_interleaves_its_rotary_where_a_config_does_not_say(model_type):
    """HF's default for these families (DeepSeek-V3's own config.json has no rope_interleave key): the rotary rows sit
    in interleaved pairs unless the config says otherwise."""
    from ridge.models.spec import spec_from_hf_config

    config = {**hf_config("deepseek_v32").to_dict(), "model_type": model_type}
    config.pop("rope_interleave", None)
    assert spec_from_hf_config(config, model_type).rope_interleave
    assert not spec_from_hf_config({**config, "rope_interleave": False}, model_type).rope_interleave


def test_the_plan_counts_the_indexer_s_keys_and_the_chosen_rows():
    """DeepSeek-V3.2's preset against DeepSeek-V3's (the same layers without the indexer): a token holds an indexer
    key of 128 beside its 576-value row in each of 61 layers; a decode reads every key and 2,048 rows, which is all it
    holds up to 2,048 tokens; a prompt's attention scores at most 2,048 keys a query, beside the indexer's own
    scoring of every causal pair."""
    from ridge.models.presets import resolve_model
    from ridge.plan import arithmetic as a

    v32, v3 = resolve_model("deepseek-v3.2"), resolve_model("deepseek-v3")
    assert a.kv_bytes_per_token(v32, "bf16") == 61 * (576 + 128) * 2 == a.kv_bytes_per_token(v3, "bf16") + 61 * 256
    assert a.kv_read_bytes(v32, "bf16", 2048) == a.kv_bytes(v32, "bf16", 2048)
    assert a.kv_read_bytes(v32, "bf16", 131072) == 61 * (131072 * 128 + 2048 * 576) * 2
    assert a.kv_read_bytes(v3, "bf16", 131072) == a.kv_bytes(v3, "bf16", 131072)
    pairs, indexer_pair = 2048 * 2049 / 2 + (8192 - 2048) * 2048, 2 * 64 * 128 * 61
    dense, sparse = a.prefill(v3, 8192), a.prefill(v32, 8192)
    per_pair = dense.attention_flops / (8192 * 8193 / 2)
    assert sparse.attention_flops == pytest.approx(per_pair * pairs + indexer_pair * 8192 * 8193 / 2)
