"""`ridge router`: the consistent hash ring, the routing policy, and the router in front of real ridge servers:
prefixes stick to a replica, streams pass through, a dead replica's requests go elsewhere, bad replicas are
refused at start-up by name."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import openai
import pytest
import uvicorn

from conftest import HTTP, running_server
from ridge import SamplingParams
from ridge.cluster.hash_ring import HashRing, prefix_key
from ridge.cluster.router import Router, RouterConfig, serving_in_thread
from ridge.config import EngineConfig
from ridge.serve.app import ServerConfig
from ridge.serve.server import free_port

KEYS = [f"tenant {i}: You are a helpful assistant for team {i}." for i in range(10_000)]


def test_adding_a_fifth_replica_moves_about_a_fifth_of_the_prefixes_all_to_it():
    four = HashRing([f"http://r{i}" for i in range(4)])
    before = {k: four.owners(k)[0] for k in KEYS}
    shares = [sum(o == m for o in before.values()) / len(KEYS) for m in four.members]
    assert all(0.18 < s < 0.32 for s in shares), shares
    four.add("http://r4")
    after = {k: four.owners(k)[0] for k in KEYS}
    moved = [k for k in KEYS if after[k] != before[k]]
    assert 0.14 < len(moved) / len(KEYS) < 0.26 and all(after[k] == "http://r4" for k in moved)
    four.remove("http://r1")  # only r1's keys move, each to the next owner it had
    again = {k: four.owners(k)[0] for k in KEYS}
    assert all(again[k] == after[k] for k in KEYS if after[k] != "http://r1")
    assert all(again[k] != "http://r1" for k in KEYS)


def test_prefix_keys_come_from_the_prompt_or_the_messages():
    chat = {"messages": [{"role": "system", "content": "S" * 50}, {"role": "user", "content": "hi"}]}
    assert prefix_key(chat, 1024) == "system:" + "S" * 50 + "\nuser:hi\n"
    assert prefix_key(chat, 10) == "system:SSS"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prefix_key(parts, 100) == "user:ab\n"
    pictured = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                           {"type": "text", "text": "what is it?"}]}]}
                for url in ("data:image/png;base64,AAAA", "data:image/png;base64,BBBB")]
    assert prefix_key(pictured[0], 100) != prefix_key(pictured[1], 100)  # images tell apart requests of one text
    assert prefix_key(pictured[0], 100).endswith("what is it?\n")
    assert prefix_key({"prompt": ["first", "second"]}, 3) == "fir"
    assert prefix_key({"prompt": list(range(10))}, 16) == "0,1,2,3"
    # the Responses API's instructions and input items read as a chat's messages; an embedding's input as a prompt
    response = {"instructions": "S" * 50, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                                    {"type": "function_call_output", "output": "x"}]}
    assert prefix_key(response, 1024) == "system:" + "S" * 50 + "\nuser:hi\n:\n"
    assert prefix_key({"input": "hi there"}, 2) == "hi" == prefix_key({"input": ["hi there", "no"]}, 2)
    # OpenAI's prompt_cache_key: requests that set one go where it hashes, whatever their texts
    keyed = [{**chat, "prompt_cache_key": "tenant-7"}, {"prompt": "other", "prompt_cache_key": "tenant-7"}]
    assert prefix_key(keyed[0], 1024) == prefix_key(keyed[1], 8) != prefix_key({"prompt": "tenant-7"}, 1024)
    assert prefix_key({"query": "a lamp", "documents": ["x"]}, 3) == "a l" == prefix_key({"text_1": "a lamp"}, 3)


def test_the_prefix_owner_yields_only_to_a_much_less_busy_replica():
    router = Router(RouterConfig(["http://a", "http://b", "http://c"], balance_abs=4, balance_rel=2.0))
    body = {"prompt": "a shared system prompt"}
    owner, how = router.choose(body, set())
    assert how == "prefix" and router.choose(body, set())[0] is owner  # the same prefix, the same replica
    owner.in_flight = 5  # 5 more than the others, but 4 more is the threshold: the owner is over it
    chosen, how = router.choose(body, set())
    assert how == "load" and chosen is not owner and chosen.in_flight == 0
    owner.in_flight = 4
    assert router.choose(body, set()) == (owner, "prefix")
    rr = Router(RouterConfig(["http://a", "http://b"], policy="round-robin"))
    assert [rr.choose(body, set())[0].url for _ in range(4)] == ["http://a", "http://b"] * 2
    with pytest.raises(LookupError, match="no healthy replica"):
        router.choose(body, {"http://a", "http://b", "http://c"})


@contextlib.contextmanager
def running_router(config: RouterConfig):
    router = Router(config)
    with serving_in_thread(router) as url:
        yield router, url


@pytest.fixture(scope="module")
def replicas(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(config, ServerConfig("smollm2"))) for _ in range(2)]


def test_the_router_keeps_a_prefix_on_one_replica_and_passes_streams(replicas, smollm2):
    with running_router(RouterConfig([r.url for r in replicas])) as (router, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        system = "You are a terse assistant for the lighthouse keepers' guild. " * 20  # past the 1,024-char key
        for question in ("What is a lamp?", "What is a lens?", "What is a storm?"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            expected = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
            got = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=12)
            assert got.choices[0].message.content == expected
        served = HTTP.get(url + "/metrics").text
        routed = [line for line in served.splitlines() if line.startswith("ridge_router:requests_total{")]
        assert len(routed) == 1 and 'routed="prefix"' in routed[0] and routed[0].endswith(" 3.0"), routed
        stream = client.completions.create(model="smollm2", prompt="Count: 1, 2,", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        expected = smollm2.generate("Count: 1, 2,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert text == expected[0].outputs[0].text
        answer = client.responses.create(model="smollm2", input=messages, temperature=0, max_output_tokens=12)
        assert answer.output_text == got.choices[0].message.content  # the last question's, by the Responses API
        # a pooling runner's routes pass through too (these replicas generate: their refusal comes back whole)
        refused = HTTP.post(url + "/v1/rerank", json={"query": "a lamp", "documents": ["a lens"]}, timeout=30)
        assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
        assert {r["in_flight"] for r in HTTP.get(url + "/replicas").json()["replicas"]} == {0}


def test_a_dead_replica_loses_no_request(smollm2_path, replicas):
    """A replica that dies under a running router: a request whose prefix it owned is retried on the live one (the
    dead one never took it), and the dead one leaves the ring; at start-up, one that does not answer is refused."""
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    with contextlib.ExitStack() as doomed_server:
        doomed = doomed_server.enter_context(running_server(config, ServerConfig("smollm2")))
        with running_router(RouterConfig([replicas[0].url, doomed.url], health_interval_s=60)) as (router, url):
            doomed_server.close()  # it stops: its port refuses connections from now on
            prompt = next(p for p in (f"Request {i} says" for i in range(1000))
                          if router.ring.owners(prefix_key({"prompt": p}, 1024))[0] == doomed.url)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2)
            assert len(got.choices) == 1 and got.usage.completion_tokens == 2
            metrics = HTTP.get(url + "/metrics").text
            assert f'ridge_router:retries_total{{replica="{doomed.url}"}} 1.0' in metrics
            assert f'ridge_router:requests_total{{replica="{replicas[0].url}",routed="retry"}} 1.0' in metrics
            assert not router.replicas[doomed.url].healthy and router.ring.members == [replicas[0].url]
    with pytest.raises(ValueError, match=f"replica: {doomed.url} does not answer"):
        asyncio.run(Router(RouterConfig([replicas[0].url, doomed.url])).start())


def test_replicas_of_another_model_are_refused_by_name(smollm2_path, replicas):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    with running_server(config, ServerConfig("another-model")) as other:
        with pytest.raises(ValueError, match=f"replica: {other.url} serves another-model, the others smollm2"):
            asyncio.run(Router(RouterConfig([replicas[0].url, other.url])).start())
        with running_router(RouterConfig([replicas[0].url])) as (router, url):
            refused = HTTP.post(url + "/replicas", json={"url": other.url})
            assert refused.status_code == 400 and "serves another-model" in refused.json()["error"]["message"]
            added = HTTP.post(url + "/replicas", json={"url": replicas[1].url})
            assert added.status_code == 200 and replicas[1].url in router.ring.members
            assert HTTP.request("DELETE", url + "/replicas", json={"url": "http://nowhere:1"}).status_code == 404
    with pytest.raises(ValueError, match="policy: 'random' is not one of"):
        RouterConfig(["http://a"], policy="random")
    with pytest.raises(ValueError, match="replica: name at least one"):
        RouterConfig([])


def test_a_replica_that_fails_mid_stream_ends_the_stream_with_an_error_not_a_retry():
    """A replica that had started a request and then died: the client gets an error event naming it (the router
    cannot know how far it got, so it does not run the request twice)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    broken = FastAPI()
    calls = []

    @broken.get("/v1/models")
    async def models():
        return {"data": [{"id": "smollm2"}]}

    @broken.post("/v1/completions")
    async def completions():
        calls.append(1)

        async def events():
            yield b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n\n'
            raise RuntimeError("the replica died")

        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    replica = uvicorn.Server(uvicorn.Config(broken, port=port, log_level="critical"))
    thread = threading.Thread(target=replica.run, daemon=True)
    thread.start()
    while not replica.started:
        time.sleep(0.05)
    try:
        with running_router(RouterConfig([f"http://127.0.0.1:{port}"])) as (router, url):
            body = {"model": "smollm2", "prompt": "Hello", "stream": True}
            with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert lines[0] == 'data: {"choices": [{"index": 0, "text": "Hel"}]}'
            assert "failed mid-stream" in lines[-1] and f"127.0.0.1:{port}" in lines[-1]
            assert len(calls) == 1  # not retried
            assert 'ridge_router:failures_total{reason="replica_failed"} 1.0' in HTTP.get(url + "/metrics").text
    finally:
        replica.should_exit = True
        thread.join(timeout=10)
