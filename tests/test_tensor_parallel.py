"""Tensor parallelism over gloo, two or three processes on this machine: greedy tokens equal one process's, on the
real models and on random configs whose heads split unevenly, and under the runtime's chunking, preemption and
prefix cache; the splits themselves; and the configurations it refuses."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from conftest import CHAT_PROMPTS, random_prompts, running_server
from ridge import LLM, SamplingParams
from ridge.cluster.shards import HEAD, ShardPlan, shard_model, shard_quantized, split_heads
from ridge.config import EngineConfig
from ridge.models.loader import load_model, open_gguf, random_model
from ridge.models.moe import MoEBlock
from ridge.models.random_weights import random_spec
from ridge.models.registry import config_from_spec
from ridge.models.spec import spec_from_gguf, spec_from_hf_config
from ridge.quant.rtn import quantize_int4, quantize_int8
from ridge.serve.app import ServerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the splits -------------------------------------------------------------------------------------
def test_heads_split_by_whole_kv_groups_where_there_are_enough():
    # SmolLM2: 9 query heads in 3 KV groups over 2 ranks: groups go 1 and 2, never cut
    assert [(s.q_heads, s.kv_heads) for s in split_heads(9, 3, 2)] == [(range(0, 3), range(0, 1)),
                                                                       (range(3, 9), range(1, 3))]
    assert [(s.q_heads, s.kv_heads) for s in split_heads(14, 2, 2)] == [(range(0, 7), range(0, 1)),
                                                                        (range(7, 14), range(1, 2))]


def test_fewer_kv_heads_than_ranks_replicate_them():
    # Gemma 3 270m: 4 query heads, 1 KV head, over 3 ranks: each holds the KV head and 1, 1 or 2 query heads
    shards = split_heads(4, 1, 3)
    assert [s.kv_heads for s in shards] == [range(0, 1)] * 3
    assert [len(s.q_heads) for s in shards] == [1, 1, 2] and shards[-1].q_heads.stop == 4
    # 8 query heads in 2 groups over 3 ranks: each rank's query heads stay inside one group
    for shard in split_heads(8, 2, 3):
        assert len(shard.kv_heads) == 1 and {q // 4 for q in shard.q_heads} == {shard.kv_heads.start}
    with pytest.raises(ValueError, match="tensor_parallel_size: 5 ranks for 4 attention heads"):
        split_heads(4, 1, 5)


def test_every_rank_sizes_its_pool_for_the_rank_with_the_most_kv_heads():
    cfg = config_from_spec(random_spec("random:smollm2"))
    plans = [ShardPlan(cfg, rank, 2) for rank in range(2)]
    assert [p.local_config().num_kv_heads for p in plans] == [1, 2]
    assert {p.pool_config().num_kv_heads for p in plans} == {2}
    assert sum(len(p.vocab_rows()) for p in plans) == cfg.vocab_size
    # the intermediate width, in whole granules of the quantization group
    assert [len(ShardPlan(cfg, rank, 2, granule=64).columns(1536)) for rank in range(2)] == [768, 768]


def test_quantized_weights_cut_on_their_group_boundaries():
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    int4, int8 = quantize_int4(w, 64), quantize_int8(w)
    cols = torch.arange(128, 256)
    cut = shard_quantized("layers.0.mlp.down", int4, {"layers.0.mlp.down": (1, cols)}, pad_to=0)
    assert torch.equal(cut.qweight, int4.qweight[:, 128:]) and torch.equal(cut.scales, int4.scales[:, 2:])
    per_row = shard_quantized("layers.0.mlp.down", int8, {"layers.0.mlp.down": (1, cols)}, pad_to=0)
    assert torch.equal(per_row.scales, int8.scales)  # a row's scale covers all its columns, on every rank
    with pytest.raises(ValueError, match="inside a quantization group of 64"):
        shard_quantized("layers.0.mlp.down", int4, {"layers.0.mlp.down": (1, torch.arange(96, 256))}, pad_to=0)
    head = shard_quantized(HEAD, int4, {HEAD: (0, torch.arange(40, 48))}, pad_to=10)  # the last vocabulary shard
    assert head.qweight.shape == (10, 256) and not head.scales[8:].any() and not head.minimums[8:].any()


def assert_each_rank_reads_what_a_whole_load_cut_holds(path: Path, cfg, world: int, **plan_args) -> None:
    """Each rank's weights, read as its part of the file, equal to the bit those of the whole model loaded and cut."""
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world, **plan_args)
        whole = load_model(path, torch.float32, progress=False).model
        shard_model(whole, plan)
        part = load_model(path, torch.float32, progress=False, shard=plan.cut_model).model
        expected, got = whole.state_dict(), part.state_dict()
        assert got.keys() == expected.keys() and part.cfg == whole.cfg
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), key
        assert got["embed_tokens.weight"].shape[0] == plan.vocab_shard


def test_a_rank_reads_from_a_gguf_file_what_a_whole_load_cut_holds(smollm2_path):
    """GGUF rows picked before they are dequantized, llama's permuted q and k rows unpermuted as they are read, the
    vocabulary's last shard padded."""
    cfg = config_from_spec(spec_from_gguf(open_gguf(smollm2_path), "smollm2", "test"))
    assert_each_rank_reads_what_a_whole_load_cut_holds(smollm2_path, cfg, 2)


@pytest.mark.parametrize(("arch", "world", "plan_args"), [("deepseek_v3", 3, {}),
                                                          ("qwen3_moe", 2, {"expert_parallel": True})])
def test_a_rank_reads_from_safetensors_what_a_whole_load_cut_holds(arch, world, plan_args, tmp_path_factory):
    """Safetensors rows read as runs of slices: latent attention's interleaved rotary rows reordered and cut by
    heads, experts cut by width or, under expert parallelism, another rank's not read at all."""
    from test_moe import random_hf_model

    path, _ = random_hf_model(arch, tmp_path_factory)
    spec = spec_from_hf_config(json.loads((path / "config.json").read_text()), arch, "test")
    assert_each_rank_reads_what_a_whole_load_cut_holds(path, config_from_spec(spec), world, **plan_args)


def test_a_rank_draws_a_random_model_s_part_as_one_process_draws_it():
    """A random model's ranks draw every weight in one process's order and keep their part (vocabulary, heads and
    widths cut unevenly over 3 ranks): to the bit the whole model's cut."""
    spec = random_spec(RANDOM["gemma3-kv-replicated"][0])
    for rank in range(3):
        plan = ShardPlan(config_from_spec(spec), rank, 3)
        whole = random_model(spec, torch.float32).model
        shard_model(whole, plan)
        part = random_model(spec, torch.float32, shard=plan.cut_model).model
        expected, got = whole.state_dict(), part.state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], t) for k, t in expected.items())


# ---- the engine over ranks --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
    chats = [smollm2.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
    return chats + random_prompts(6, smollm2.engine.loaded.config.vocab_size, 3, 300, seed=5)  # 10, mixed


@pytest.fixture(scope="module")
def one_process(smollm2, smollm2_prompts):
    """The prompts' greedy tokens on one process (batched: test_runtime_invariance holds that to each alone)."""
    return tokens(smollm2.generate(smollm2_prompts, GREEDY))


def test_smollm2_over_two_ranks_equals_one_process(smollm2, smollm2_path, smollm2_prompts, one_process,
                                                  make_llm_for_test):
    """10 mixed prompts (some longer than the 128-token budget: chunked) over two ranks; prompt logprobs (the
    output projection's gathers rank 0 makes after a step) too."""
    alone = one_process
    tp = make_llm_for_test(smollm2_path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=128)
    assert "rank 0 of 2" in tp.engine.loaded.weight_format
    assert tp.engine.runner.local.decode_stack is not None  # decode steps in C++, all-reducing between layers
    assert tokens(tp.generate(smollm2_prompts, GREEDY)) == alone
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=3)
    [mine], [theirs] = tp.generate(smollm2_prompts[0], scored), smollm2.generate(smollm2_prompts[0], scored)
    assert len(mine.prompt_logprobs) == len(theirs.prompt_logprobs) > 0
    for a, b in zip(mine.prompt_logprobs[1:] + mine.outputs[0].logprobs,
                    theirs.prompt_logprobs[1:] + theirs.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a)
    torch.testing.assert_close(tp.engine.prompt_logits(smollm2_prompts[1]),
                               smollm2.engine.prompt_logits(smollm2_prompts[1]), atol=2e-3, rtol=0)
    tp.engine.close()


def test_the_runtime_under_two_ranks_keeps_the_tokens(make_llm_for_test):
    """A token budget of 40 (chunks), a pool of 24 blocks (preemption and recompute), the prefix cache (a second
    pass hits it): the tokens stay one process's. On SmolLM2's shape cut to 4 layers (the real file's tokens over
    ranks: the test above)."""
    model = "random:smollm2,num_layers=4,vocab_size=2048"
    one = make_llm_for_test(model, dtype="float32", kv_cache_memory="16MiB")
    prompts = random_prompts(8, 2048, 3, 300, seed=5)
    alone = tokens(one.generate(prompts, GREEDY))
    per_block = 16 * 4 * 2 * 2 * 64 * 4  # the rank with 2 of the 3 KV heads sizes the pool
    tp = make_llm_for_test(model, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=40,
                           kv_cache_memory=24 * per_block)
    assert tp.engine.pool.num_blocks == 24
    outs = tp.generate(prompts, GREEDY)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was meant to force preemption"
    assert tokens(outs) == alone
    again = tp.generate(prompts, GREEDY)
    assert tokens(again) == alone and sum(o.num_cached_tokens for o in again) > 0
    tp.engine.close()


def test_qwen_over_two_ranks_equals_one_process(qwen_path, make_llm_for_test):
    # the one-process reference made and freed here, not the session's qwen_float32: a worker that holds neither
    # would keep 2 GB for the rest of the session, and the suite's workers share 24 GiB
    one = LLM(str(qwen_path), dtype="float32", kv_cache_memory="64MiB", progress=False)
    prompts = [one.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:2]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = tokens(one.generate(prompts, greedy))
    one.engine.check_integrity()
    del one
    gc.collect()
    tp = make_llm_for_test(qwen_path, dtype="float32", tensor_parallel_size=2, kv_cache_memory="64MiB")
    assert tokens(tp.generate(prompts, greedy)) == expected
    tp.engine.close()


def test_gguf_blocks_over_two_ranks_equal_one_process(smollm2_path, smollm2_prompts, make_llm_for_test):
    """The file's Q4_1 layers and Q8_0 embedding kept as they are, cut between the ranks on their blocks' groups
    (q, k and v each a part of the fused projection; the tied head from the embedding's cut, the lookup from a
    dense shard of it). (qwen2.5-coder-0.5b's Q4_K / Q5_0 / Q6_K / Q8_0 file, biases and all, was checked the same
    way by hand: equal tokens.)"""
    prompts = smollm2_prompts[:4]
    common = {"quantization": "gguf", "dtype": "float32", "max_num_batched_tokens": 64, "kv_cache_memory": "32MiB"}
    one = make_llm_for_test(smollm2_path, **common)
    expected = tokens(one.generate(prompts, GREEDY))
    tp = make_llm_for_test(smollm2_path, **common, tensor_parallel_size=2)
    assert "native" in tp.engine.loaded.weight_format and "rank 0 of 2" in tp.engine.loaded.weight_format
    assert tokens(tp.generate(prompts, GREEDY)) == expected
    tp.engine.close()


RANDOM = {  # shapes whose heads, widths and vocabularies do not split evenly
    "gemma3-kv-replicated": ("random:gemma3-270m,num_layers=3,vocab_size=1001,hidden_size=128,head_dim=32,"
                             "intermediate_size=160,sliding_window=24,global_every=3", 3, {}),
    "smollm2-uneven-groups": ("random:smollm2,num_layers=2,vocab_size=999,hidden_size=144,head_dim=16,"
                              "intermediate_size=192", 2, {}),
    "qwen2-int4": ("random:qwen2.5-coder-0.5b,num_layers=2,vocab_size=1000,hidden_size=224,head_dim=32,"
                   "intermediate_size=256", 2, {"quantization": "int4", "quantization_group_size": 32}),
    "qwen3-moe": ("random:qwen3-30b-a3b,num_layers=2,vocab_size=1000,hidden_size=128,num_heads=8,num_kv_heads=2,"
                  "head_dim=16,num_experts=8,experts_per_token=2,moe_intermediate_size=64", 2, {}),
    # expert parallelism: 8 whole experts over 2 ranks, 4 each
    "qwen3-moe-expert-parallel": ("random:qwen3-30b-a3b,num_layers=2,vocab_size=1000,hidden_size=128,num_heads=8,"
                                  "num_kv_heads=2,head_dim=16,num_experts=8,experts_per_token=2,"
                                  "moe_intermediate_size=64", 2, {"enable_expert_parallel": True}),
    # latent attention: 4 heads over 3 ranks (1, 1, 2), the latent cached whole on each; V2's shared experts
    "deepseek-v2-mla": ("random:deepseek-v2-lite,num_layers=2,vocab_size=1000,hidden_size=128,num_heads=4,"
                        "num_kv_heads=4,head_dim=32,kv_lora_rank=32,qk_rope_head_dim=16,qk_nope_head_dim=16,"
                        "v_head_dim=16,num_experts=8,experts_per_token=2,moe_intermediate_size=32,"
                        "intermediate_size=64", 3, {}),
    # V3: the query's own bottleneck, sigmoid routing over groups
    "deepseek-v3-mla": ("random:deepseek-v3,num_layers=2,vocab_size=1000,hidden_size=128,num_heads=4,num_kv_heads=4,"
                        "head_dim=32,kv_lora_rank=32,q_lora_rank=48,qk_rope_head_dim=16,qk_nope_head_dim=16,"
                        "v_head_dim=16,num_experts=8,experts_per_token=2,moe_intermediate_size=32,"
                        "intermediate_size=64,first_dense_layers=1,router_groups=2,router_topk_groups=1", 2, {}),
    # V3.2: sparse attention, the indexer replicated on each rank (its keys cached whole there), 12 of the keys
    # chosen for prompts of up to 80 tokens
    "deepseek-v3.2-sparse": ("random:deepseek-v3.2,num_layers=2,vocab_size=1000,hidden_size=128,num_heads=4,"
                             "num_kv_heads=4,head_dim=32,kv_lora_rank=32,q_lora_rank=48,qk_rope_head_dim=16,"
                             "qk_nope_head_dim=16,v_head_dim=16,num_experts=8,experts_per_token=2,"
                             "moe_intermediate_size=32,intermediate_size=64,first_dense_layers=1,router_groups=2,"
                             "router_topk_groups=1,index_topk=12,index_heads=4,index_head_dim=32", 2, {}),
    # state-space heads over 3 ranks: group 0 whole on rank 0, group 1 split between ranks 1 and 2, whose norm over
    # it is summed across them
    "mamba2-split-group": ("random:mamba2-2.7b,num_layers=2,vocab_size=1000,hidden_size=128,ssm_num_heads=6,"
                           "ssm_head_dim=16,ssm_state_size=16,ssm_groups=2", 3, {}),
    # the hybrid: attention and Mamba-2 layers, one group of B and C split between the ranks
    "bamba-hybrid": ("random:bamba-9b,num_layers=3,vocab_size=1000,hidden_size=128,num_heads=4,num_kv_heads=2,"
                     "head_dim=32,ssm_num_heads=8,ssm_head_dim=16,ssm_state_size=16,intermediate_size=128", 2, {}),
    # Granite 4.0-H: Mamba-2 layers and one attention layer without rotary, each with experts and a shared MLP
    "granite-hybrid": ("random:granite-4.0-h-tiny,num_layers=6,vocab_size=1000,hidden_size=128,num_heads=4,"
                       "num_kv_heads=2,head_dim=32,ssm_num_heads=8,ssm_head_dim=32,ssm_state_size=16,"
                       "intermediate_size=64,moe_intermediate_size=64,num_experts=8,experts_per_token=2,"
                       "shared_expert_intermediate_size=64", 2, {}),
    # Qwen3.5: gated DeltaNet layers (6 value heads over 2 query / key heads: the second group's split between
    # ranks 1 and 2) beside gated attention, experts and a gated shared expert
    "qwen3.5-moe-split-group": ("random:qwen3.5-35b-a3b,num_layers=4,vocab_size=1000,hidden_size=128,num_heads=4,"
                                "num_kv_heads=2,head_dim=32,ssm_num_heads=6,ssm_head_dim=16,ssm_state_size=16,"
                                "ssm_groups=2,num_experts=8,experts_per_token=2,moe_intermediate_size=32,"
                                "shared_expert_intermediate_size=48", 3, {}),
    # Llama 4: chunked windows (16 tokens here) beside a global NoPE layer, q / k L2-normed per head, 6 query heads
    # over 3 ranks (2 KV heads replicated), experts reading score-scaled inputs on every second layer
    "llama4-chunked": ("random:llama-4-scout,num_layers=4,vocab_size=1000,hidden_size=128,num_heads=6,num_kv_heads=2,"
                       "head_dim=16,num_experts=8,moe_intermediate_size=32,intermediate_size=64,sliding_window=16,"
                       "moe_layer_step=2", 3, {}),
    # and in a GGUF's tiled order of value heads (8 over 4 groups): each rank's every other head
    "qwen3.5-tiled-heads": ("random:qwen3.5-9b,num_layers=4,vocab_size=1000,hidden_size=128,num_heads=4,"
                            "num_kv_heads=2,head_dim=32,ssm_num_heads=8,ssm_head_dim=16,ssm_state_size=16,"
                            "ssm_groups=4,intermediate_size=96,ssm_heads_tiled=true", 2, {}),
}


@pytest.mark.parametrize("name", RANDOM)
def test_random_shapes_over_ranks_equal_one_process(name, make_llm_for_test):
    model, ranks, extra = RANDOM[name]
    common = {"dtype": "float32", "max_num_batched_tokens": 32, "kv_cache_memory": "16MiB"}
    one = make_llm_for_test(model, **common, **{k: v for k, v in extra.items() if k != "enable_expert_parallel"})
    prompts = random_prompts(6, 900, 2, 80, seed=7)
    expected = tokens(one.generate(prompts, GREEDY))
    tp = make_llm_for_test(model, tensor_parallel_size=ranks, **common, **extra)
    assert tokens(tp.generate(prompts, GREEDY)) == expected
    if extra.get("enable_expert_parallel"):  # rank 0 holds its half of each layer's experts, and only those
        held = [sum(p.numel() for p in m.experts.parameters()) for m in tp.engine.loaded.model.modules()
                if isinstance(m, MoEBlock)]
        whole = [sum(p.numel() for p in m.experts.parameters()) for m in one.engine.loaded.model.modules()
                 if isinstance(m, MoEBlock)]
        assert held == [w // 2 for w in whole]
        assert tp.engine.runner.local.decode_stack is not None  # which skips the experts another rank holds
    tp.engine.close()


@pytest.mark.parametrize("name", ["mamba2-split-group", "bamba-hybrid", "qwen3.5-moe-split-group"])
def test_state_snapshots_resume_on_every_rank(name, make_llm_for_test):
    """Prefix caching on state-space layers over ranks: each rank copies its own heads' states into and out of
    its snapshot slots, so the last of three requests sharing two blocks resumes there with one process's tokens."""
    model, ranks, _ = RANDOM[name]
    common = {"dtype": "float32", "max_num_batched_tokens": 32, "kv_cache_memory": "16MiB"}
    shared = random_prompts(1, 900, 40, 41, seed=3)[0]
    prompts = [shared + own for own in random_prompts(3, 900, 5, 20, seed=4)]
    expected = tokens(make_llm_for_test(model, enable_prefix_caching=False, **common).generate(prompts, GREEDY))
    tp = make_llm_for_test(model, tensor_parallel_size=ranks, **common)
    outs = [tp.generate([prompt], GREEDY)[0] for prompt in prompts]
    assert tokens(outs) == expected
    # the shared blocks' snapshot: left by the first (where its prompt's last full block ends there) or the second
    assert outs[0].num_cached_tokens == 0 and outs[2].num_cached_tokens == 32
    tp.engine.close()


def test_the_server_serves_over_two_ranks(smollm2, smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=2)
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    expected = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    with running_server(config, ServerConfig("smollm2")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        got = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=24)
    assert got.choices[0].message.content == expected


def test_torchrun_starts_the_ranks(smollm2, smollm2_path):
    """`torchrun --nproc-per-node 2 -m ridge.cli generate --tensor-parallel-size 2`: rank 0 generates, rank 1
    runs its steps, both exit 0."""
    from ridge.serve.server import free_port

    expected = smollm2.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "ridge.cli", "generate", "--model", str(smollm2_path), "--tensor-parallel-size", "2", "--dtype",
         "float32", "--kv-cache-memory", "64MiB", "--prompt", "The capital of France is", "--max-tokens", "8",
         "--temperature", "0"],
        capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected[0].outputs[0].text in done.stdout


def _my_ranks() -> list[int]:
    """The pids of the tensor-parallel ranks this process started (engine/processes.py) whose processes still run."""
    return [p.pid for p in multiprocessing.active_children()
            if p.name.startswith("ridge-rank") and Path(f"/proc/{p.pid}").exists()]


def test_a_rank_0_that_fails_after_the_others_started_stops_them(smollm2_path, monkeypatch):
    """Rank 0 failing once the other ranks are up (a fault injected where it gives its model the collectives): they
    stop rather than wait for steps that never come."""
    from ridge.engine import tensor_parallel

    def broken(*_):
        raise RuntimeError("injected")

    monkeypatch.setattr(tensor_parallel, "install_collectives", broken)
    with pytest.raises(RuntimeError, match="injected"):
        LLM(str(smollm2_path), dtype="float32", tensor_parallel_size=2, kv_cache_memory="16MiB", progress=False)
    assert _my_ranks() == []


def test_a_rank_0_that_fails_to_load_beside_the_others_stops_them(smollm2_path, monkeypatch):
    """Ranks that read only their part of the file meet before they load, side by side: rank 0 failing in its
    load stops the others (which finish their own load first)."""
    from ridge.engine import engine

    def broken(*_, **__):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine, "load_weights", broken)
    with pytest.raises(RuntimeError, match="injected"):
        LLM(str(smollm2_path), dtype="float32", tensor_parallel_size=2, kv_cache_memory="16MiB", progress=False)
    assert _my_ranks() == []


def test_a_window_ignored_at_load_stays_ignored_on_every_rank(make_llm_for_test):
    """ignore_sliding_window, on a random model too, and over ranks: every rank's part of the model attends to the
    whole history, as one process does (prompts past the 24-token window)."""
    common = {"dtype": "float32", "max_num_batched_tokens": 32, "kv_cache_memory": "16MiB",
              "ignore_sliding_window": True}
    model = RANDOM["gemma3-kv-replicated"][0]
    prompts = random_prompts(3, 1001, 40, 80, seed=3)
    one = make_llm_for_test(model, **common)
    expected = tokens(one.generate(prompts, GREEDY))
    tp = make_llm_for_test(model, **common, tensor_parallel_size=2)
    assert one.engine.loaded.model.cfg.sliding_window == tp.engine.loaded.model.cfg.sliding_window == 0
    assert tokens(tp.generate(prompts, GREEDY)) == expected
    tp.engine.close()


def test_olmoe_norms_over_all_heads_over_ranks(tmp_path, make_llm_for_test):
    """OLMoE normalises q and k over all their heads at once: each rank's squares summed over the ranks, its one KV
    head (replicated on the 3 ranks) counted once."""
    from test_moe import VOCAB as MOE_VOCAB
    from test_moe import hf_config as moe_config

    config = {**moe_config("olmoe").to_dict(), "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = f"random:{tmp_path / 'config.json'}"
    common = {"dtype": "float32", "max_num_batched_tokens": 32, "kv_cache_memory": "16MiB"}
    prompts = random_prompts(5, MOE_VOCAB, 2, 60, seed=7)
    expected = tokens(make_llm_for_test(model, **common).generate(prompts, GREEDY))
    tp = make_llm_for_test(model, **common, tensor_parallel_size=3)
    assert tokens(tp.generate(prompts, GREEDY)) == expected
    tp.engine.close()


def test_ranks_that_cannot_map_shared_memory_all_reduce_through_gloo(monkeypatch, make_llm_for_test):
    """Where rank 0 cannot make the shared-memory segment (a /dev/shm too small, say), no rank uses it: the
    all-reduces go through gloo, with the same tokens."""
    from ridge.cluster.shm_reduce import SharedMemoryReducer

    def refuse(*args, **kwargs):
        raise OSError("no space left on device")

    model = "random:smollm2,num_layers=2,vocab_size=999,hidden_size=144,head_dim=16,intermediate_size=192"
    common = {"dtype": "float32", "kv_cache_memory": "16MiB"}
    prompts = random_prompts(3, 900, 2, 40, seed=9)
    expected = tokens(make_llm_for_test(model, **common).generate(prompts, GREEDY))
    monkeypatch.setattr(SharedMemoryReducer, "create", refuse)
    tp = make_llm_for_test(model, **common, tensor_parallel_size=2)
    assert tp.engine.runner.group.local is None
    assert tokens(tp.generate(prompts, GREEDY)) == expected
    tp.engine.close()


# ---- what it refuses --------------------------------------------------------------------------------
def test_what_tensor_parallelism_refuses_is_named(smollm2_path):
    with pytest.raises(ValueError, match="tensor_parallel_size: 5 ranks for 4 attention heads"):
        LLM("random:gemma3-270m,num_layers=1,vocab_size=512", tensor_parallel_size=5, progress=False)
    with pytest.raises(ValueError, match="o_proj's input at column 192, inside a quantization group of 128"):
        LLM(str(smollm2_path), quantization="int4", quantization_group_size=128, tensor_parallel_size=2,
            progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks for 2 state-space heads"):
        LLM("random:mamba2-2.7b,num_layers=1,vocab_size=512,hidden_size=128,ssm_num_heads=2,ssm_head_dim=16",
            tensor_parallel_size=4, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size: LFM2's short-convolution layers"):
        LLM("random:lfm2-1.2b,num_layers=3,vocab_size=512,hidden_size=128,num_heads=4,num_kv_heads=2,head_dim=32,"
            "intermediate_size=128", tensor_parallel_size=2, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 with a draft model"):
        EngineConfig(model="m", tensor_parallel_size=2, draft_model="d")
    with pytest.raises(ValueError, match="enable_expert_parallel: llama has no experts"):
        LLM("random:smollm2,num_layers=1,vocab_size=512", tensor_parallel_size=2, enable_expert_parallel=True,
            progress=False)
    with pytest.raises(ValueError, match="enable_expert_parallel: splits the experts between tensor-parallel ranks"):
        EngineConfig(model="m", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be at least 1, got 0"):
        EngineConfig(model="m", tensor_parallel_size=0)


def test_bench_tp_measures_one_process_beside_the_ranks(capsys):
    """`ridge bench tp`: one process and two ranks on the same model, each row with its load, decode and batch
    figures; the ranks' step makes two all-reduces a layer, the embedding's and the logits' gather."""
    from ridge.cli import main

    layers = 2
    assert main(["bench", "tp", "--model", f"random:smollm2,num_layers={layers},vocab_size=2048", "--dtype",
                 "float32", "--input-len", "16", "--output-len", "4", "--batch", "2", "--repeats", "1",
                 "--json"]) == 0
    one, two = json.loads(capsys.readouterr().out)["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["threads_per_rank"] == two["threads_per_rank"]
    assert (one["collectives_per_token"], two["collectives_per_token"]) == (0, 2 * layers + 2)
    assert 0 < two["collective_ms_per_token"] < two["ms_per_token"] and two["predicted_collective_ms_per_token"] > 0
    for row in (one, two):
        assert row["load_s"] > 0 and row["batch_tok_s"] > 0
        assert row["decode_vs_one"] == pytest.approx(one["ms_per_token"] / row["ms_per_token"])
    assert two["transport"] == "shared memory" and two["link"]["latency_us"] > 0
