"""Disaggregated prefill and decode: a prompt's KV computed by one engine, adopted by another's prefix cache, and
the tokens the colocated run gives; over HTTP, through `ridge router --prefill --decode`."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest
import torch

from conftest import CHAT_PROMPTS, HTTP, random_prompts, running_server
from ridge import SamplingParams
from ridge.cluster.router import Router, RouterConfig, serving_in_thread
from ridge.config import EngineConfig
from ridge.engine.kv_transfer import check_transferable, export_prefix, import_prefix
from ridge.serve.app import ServerConfig
from ridge.serve.kv_transfer import check_role
from ridge.serve.server import make_server

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_moved_to_another_engine_give_the_colocated_tokens(smollm2_path, make_llm_for_test, kv_cache_dtype):
    common = {"dtype": "float32", "kv_cache_memory": "32MiB", "kv_cache_dtype": kv_cache_dtype}
    prefill, decode = make_llm_for_test(smollm2_path, **common), make_llm_for_test(smollm2_path, **common)
    prompts = random_prompts(3, 49152, 40, 200, seed=11)
    colocated = [o.outputs[0].token_ids for o in prefill.generate(prompts, GREEDY)]
    for prompt, expected in zip(prompts, colocated, strict=True):
        prefill.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
        blocks = export_prefix(prefill.engine, prompt, None)
        assert blocks.num_blocks == len(prompt) // 16 and blocks.token_ids == prompt[: blocks.num_blocks * 16]
        assert import_prefix(decode.engine, blocks) == blocks.num_blocks
        assert import_prefix(decode.engine, blocks) == 0  # cached already: nothing adopted twice
        (out,) = decode.generate(prompt, GREEDY)
        # the colocated engine's own run over its cached prefix; in float32 that is the cold run's too (a quantized
        # cache's prefix-cache hit reads the prompt's K and V as codes, where a cold prefill attends to them whole)
        (warm,) = prefill.generate(prompt, GREEDY)
        assert out.outputs[0].token_ids == warm.outputs[0].token_ids
        assert kv_cache_dtype != "auto" or out.outputs[0].token_ids == expected
        assert out.num_cached_tokens == min(blocks.num_blocks, (len(prompt) - 1) // 16) * 16
    decode.engine.check_integrity()
    # a salted request's blocks are keyed by its salt: another salt finds none of them
    salted = SamplingParams(temperature=0, max_tokens=1, cache_salt="tenant-a")
    prefill.generate(prompts[0], salted)
    assert export_prefix(prefill.engine, prompts[0], "tenant-b").num_blocks == 0
    assert export_prefix(prefill.engine, prompts[0], "tenant-a").num_blocks == len(prompts[0]) // 16


def test_sliding_window_blocks_move_by_group(make_llm_for_test):
    """A model of sliding-window and global layers (Gemma 3's pattern, a window of 24 tokens): its full-attention
    group sends every block of the prefix, its window group only those of the window at the prefix's end (the
    ones before it are the null block there), and the decode engine's hit reads both as the colocated one does."""
    model = ("random:gemma3-270m,num_layers=3,vocab_size=1001,hidden_size=128,head_dim=32,intermediate_size=160,"
             "sliding_window=24,global_every=3")
    common = {"dtype": "float32", "kv_cache_memory": "16MiB"}
    prefill, decode = make_llm_for_test(model, **common), make_llm_for_test(model, **common)
    for prompt in random_prompts(3, 1001, 70, 150, seed=12):
        (expected,) = prefill.generate(prompt, GREEDY)
        blocks = export_prefix(prefill.engine, prompt, None)
        full, *windows = blocks.groups  # the global layers' group, then each sliding-window group
        assert full == list(range(blocks.num_blocks)) and windows
        for window in windows:  # the window of the prefix's end, from one block earlier
            assert 0 < len(window) < blocks.num_blocks
            assert window == list(range(blocks.num_blocks - len(window), blocks.num_blocks))
        assert import_prefix(decode.engine, blocks) == sum(map(len, blocks.groups))
        (out,) = decode.generate(prompt, GREEDY)
        assert out.num_cached_tokens == min(blocks.num_blocks, (len(prompt) - 1) // 16) * 16 > 0
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    decode.engine.check_integrity()


def test_blocks_of_another_layout_are_refused_by_name(smollm2_path, make_llm_for_test):
    f32 = make_llm_for_test(smollm2_path, dtype="float32", kv_cache_memory="16MiB")
    bf16 = make_llm_for_test(smollm2_path, dtype="bfloat16", kv_cache_memory="16MiB")
    prompt = random_prompts(1, 49152, 64, 65, seed=3)[0]
    f32.generate(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="kv: the blocks' layout .* is not this engine's"):
        import_prefix(bf16.engine, export_prefix(f32.engine, prompt, None))
    no_cache = make_llm_for_test(smollm2_path, dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="role: disaggregated prefill moves prefix-cache blocks"):
        check_transferable(no_cache.engine)
    # the server refuses the role before loading anything
    with pytest.raises(ValueError, match="role: decode .*enable_prefix_caching must be on"):
        make_server(EngineConfig(model=str(smollm2_path), enable_prefix_caching=False),
                    ServerConfig("m", role="decode"))
    with pytest.raises(ValueError, match="role: 'middle' is not one of both, prefill, decode"):
        check_role("middle", EngineConfig(model="m"))


def test_blocks_move_between_engines_of_any_tensor_parallel_size(smollm2_path, make_llm_for_test):
    """SmolLM2's 3 KV heads cut 1 + 2 over two ranks: an export joins the ranks' parts into whole blocks, and an
    import cuts them again for its own ranks, so blocks move 2 ranks -> 1 and 1 -> 2 (2 -> 2 is the two in turn),
    and every decode engine's tokens are the colocated run's."""
    common = {"dtype": "float32", "kv_cache_memory": "32MiB"}
    two = make_llm_for_test(smollm2_path, tensor_parallel_size=2, **common)
    one = make_llm_for_test(smollm2_path, **common)
    for seed, (prefill, decode) in enumerate(((two, one), (one, two))):
        for prompt in random_prompts(1, 49152, 60, 130, seed=13 + seed):  # a prompt new to both engines
            (expected,) = prefill.generate(prompt, GREEDY)
            blocks = export_prefix(prefill.engine, prompt, None)
            assert blocks.num_blocks == len(prompt) // 16 and blocks.data[0].shape[1] == 3  # every KV head
            assert import_prefix(decode.engine, blocks) == blocks.num_blocks
            (out,) = decode.generate(prompt, GREEDY)
            assert out.num_cached_tokens == min(blocks.num_blocks, (len(prompt) - 1) // 16) * 16 > 0
            assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        decode.engine.check_integrity()
    two.engine.close()


def test_joined_heads_are_cut_back_to_each_rank_s_part():
    """join_heads and cut_heads round-trip each rank's heads, a head replicated over ranks taken once."""
    from ridge.cluster.shards import cut_heads, join_heads

    whole = [torch.arange(2 * 5 * 3).view(2, 5, 3), torch.arange(2 * 5).view(2, 5)]
    for shards in ([range(0, 2), range(2, 5)], [range(0, 1), range(0, 1), range(1, 3), range(3, 5)]):
        parts = cut_heads(whole, shards, len(shards))
        assert [p[0].shape[1] for p in parts] == [len(r) for r in shards]
        assert all(torch.equal(a, b) for a, b in zip(join_heads(parts, shards), whole, strict=True))
    assert cut_heads(whole, None, 2) == [whole, whole] and join_heads([whole, whole], None) is whole


def test_latent_attention_s_rows_move_whole_between_tensor_parallel_sizes(tmp_path_factory, make_llm_for_test):
    """Latent attention caches every head's row on every rank: a 2-rank engine exports rank 0's, and a 2-rank engine
    imports them on both ranks, from and to one process; the colocated run's tokens."""
    import test_moe

    path, _ = test_moe.random_hf_model("deepseek_v2", tmp_path_factory)
    common = {"dtype": "float32", "kv_cache_memory": "16MiB"}
    two, one = make_llm_for_test(path, tensor_parallel_size=2, **common), make_llm_for_test(path, **common)
    for seed, (prefill, decode) in enumerate(((two, one), (one, two))):
        (prompt,) = random_prompts(1, test_moe.VOCAB, 40, 60, seed=20 + seed)
        (expected,) = prefill.generate(prompt, GREEDY)
        blocks = export_prefix(prefill.engine, prompt, None)
        assert import_prefix(decode.engine, blocks) == blocks.num_blocks == len(prompt) // 16
        (out,) = decode.generate(prompt, GREEDY)
        assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == expected.outputs[0].token_ids
        decode.engine.check_integrity()
    two.engine.close()


@pytest.fixture(scope="module")
def pair(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(running_server(config, ServerConfig("smollm2", role="prefill")))
        decode = stack.enter_context(running_server(config, ServerConfig("smollm2", role="decode")))
        yield prefill, decode


def test_the_router_prefills_on_one_server_and_decodes_on_another(pair, smollm2):
    prefill, decode = pair
    router = Router(RouterConfig([decode.url], prefill=[prefill.url]))
    with serving_in_thread(router) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for question in CHAT_PROMPTS[:3]:
            messages = [{"role": "system", "content": "You answer in one short sentence. " * 8},
                        {"role": "user", "content": question}]
            expected = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
            got = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=16)
            assert got.choices[0].message.content == expected
            # the decode server found every full block before the last token's: the prefill server's
            assert got.usage.prompt_tokens_details.cached_tokens == 16 * ((got.usage.prompt_tokens - 1) // 16)
        stream = client.completions.create(model="smollm2", prompt="Count slowly: one, two, three,", max_tokens=8,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in stream if c.choices)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert text == smollm2.generate("Count slowly: one, two, three,", params)[0].outputs[0].text
        metrics = HTTP.get(url + "/metrics").text
        assert f'ridge_router:requests_total{{replica="{prefill.url}",routed="prefill"}} 4.0' in metrics


def test_kv_transfer_params_are_refused_where_they_cannot_be_honoured(pair, smollm2_path):
    prefill, decode = pair
    body = {"prompt": "Hello there", "max_tokens": 1, "kv_transfer_params": {"push_to": decode.url}}
    refused = HTTP.post(decode.url + "/v1/completions", json=body)  # a decode server pushes nothing
    assert refused.status_code == 400 and "this server's role is decode" in refused.json()["error"]["message"]
    streamed = HTTP.post(prefill.url + "/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "not with stream" in streamed.json()["error"]["message"]
    nowhere = HTTP.post(prefill.url + "/v1/completions",
                        json={**body, "kv_transfer_params": {"push_to": "http://127.0.0.1:9"}}, timeout=60)
    assert nowhere.status_code == 502 and "did not take the KV" in nowhere.json()["error"]["message"]
    pushed = HTTP.post(prefill.url + "/v1/completions", json={**body, "prompt": "Hello there " * 20}, timeout=60)
    moved = pushed.json()["kv_transfer_params"]
    assert moved["blocks"] == moved["tokens"] // 16 > 0 and moved["bytes"] > moved["blocks"] * 16 * 30 * 2 * 3 * 64 * 4
    junk = HTTP.post(decode.url + "/kv/import", content=b"not a tensor",
                     headers={"Content-Type": "application/octet-stream"})
    assert junk.status_code == 400 and junk.json()["error"]["param"] == "body"
    assert HTTP.post(prefill.url + "/kv/import", content=b"x").status_code in (404, 405, 415)


def test_no_prefill_server_to_take_a_request_is_a_503_naming_them(pair):
    """A request whose prefill no server can take fails with 503 naming the prefill servers, not the decode one."""
    import asyncio

    _, decode = pair
    router = Router(RouterConfig([decode.url], prefill=["http://127.0.0.1:9"]))

    async def prefill_on_a_dead_server():
        router.client = httpx.AsyncClient(timeout=10)
        try:
            return await router._prefill({"prompt": "Hello"}, "/v1/completions", {}, router.replicas[decode.url])
        finally:
            await router.stop()

    with pytest.raises(LookupError, match=r"no prefill server could take the request \(tried http://127.0.0.1:9\)"):
        asyncio.run(prefill_on_a_dead_server())
    assert not router.prefills["http://127.0.0.1:9"].healthy and router.prefill_ring.members == []
