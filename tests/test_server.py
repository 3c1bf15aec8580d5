"""The OpenAI-compatible server, through the real `openai` client and raw HTTP, on a loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import CHAT_PROMPTS, HTTP, running_server
from ridge import BeamSearchParams, SamplingParams
from ridge.config import EngineConfig
from ridge.serve.app import ServerConfig
from ridge.serve.server import free_port, make_server, start_in_thread

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="256MiB")
    with running_server(config, ServerConfig("smollm2", api_key=KEY, max_body_bytes=64 * 1024),
                        max_waiting=256) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_chat_greedy_equals_llm_generate(client, smollm2):
    for prompt in CHAT_PROMPTS[:2]:
        messages = [{"role": "user", "content": prompt}]
        expected = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
        got = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=32)
        assert got.choices[0].message.content == expected.text
        assert got.choices[0].finish_reason == expected.finish_reason
        assert got.usage.completion_tokens == len(expected.token_ids)


def test_completions_prompt_forms_equal_llm_generate(client, smollm2):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = ["The quick brown fox", "def fibonacci(n):"]
    expected = [o.outputs[0].text for o in smollm2.generate(texts, params)]
    got = client.completions.create(model="smollm2", prompt=texts, temperature=0, max_tokens=16,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert got.usage.completion_tokens == 32
    ids = smollm2.tokenizer.encode(texts[0])
    by_ids = client.completions.create(model="smollm2", prompt=ids, temperature=0, max_tokens=16,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected[0]
    echoed = client.completions.create(model="smollm2", prompt=texts[0], temperature=0, max_tokens=16, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == texts[0] + expected[0]


def test_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]

    prompt = "Once upon a time"
    whole = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=24)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=prompt, temperature=0, max_tokens=24, stream=True) if c.choices)
    assert text == whole.choices[0].text


def test_n_samples_seeds_and_logprobs(client):
    messages = [{"role": "user", "content": CHAT_PROMPTS[5]}]
    out = client.chat.completions.create(model="smollm2", messages=messages, n=3, temperature=1.0, seed=7,
                                         max_tokens=12, logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    again = client.chat.completions.create(model="smollm2", messages=messages, n=3, temperature=1.0, seed=7,
                                           max_tokens=12, logprobs=True, top_logprobs=3)
    assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]
    for choice in out.choices:
        entries = choice.logprobs.content
        assert len(entries) == out.usage.completion_tokens // 3 or choice.finish_reason == "stop"
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    completion = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                           logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # greedy: the chosen token is the most likely one
    assert all(t in top and top[t] == max(top.values()) for t, top in zip(lp.tokens, lp.top_logprobs, strict=True))


def test_stop_strings_and_logit_bias(client, smollm2):
    messages = [{"role": "user", "content": "List three primary colors, one per line."}]
    out = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=60,
                                         stop=["\n"])
    assert "\n" not in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=60, stop=["\n"], stream=True) if c.choices)
    assert streamed == out.choices[0].message.content
    first = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                      max_tokens=1, logprobs=0)
    token_id = smollm2.tokenizer.encode(first.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                       max_tokens=1, logit_bias={str(token_id): -100})
    assert banned.choices[0].text != first.choices[0].text


def test_stop_strings_found_by_the_server_equal_the_engine_s(client, smollm2):
    """The server finds stop strings in its own process; samples that stop at different steps, a stop string
    kept in the output, and min_tokens must end exactly where the in-process engine ends them."""
    prompt = "Write a short story about a cat. Once upon a time"
    cases = [dict(stop=[" the", "."]), dict(stop=[" a"], include_stop_str_in_output=True),
             dict(stop=["."], min_tokens=12)]
    for case in cases:
        params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=40, **case)
        expected = smollm2.generate([prompt], params)[0].outputs
        got = client.completions.create(model="smollm2", prompt=prompt, n=3, temperature=0.9, seed=11, max_tokens=40,
                                        stop=case["stop"], extra_body={k: v for k, v in case.items() if k != "stop"})
        choices = sorted(got.choices, key=lambda c: c.index)
        assert [c.text for c in choices] == [e.text for e in expected], case
        assert [c.finish_reason for c in choices] == [e.finish_reason for e in expected], case
        assert [c.model_extra["stop_reason"] for c in choices] == [e.stop_reason for e in expected], case
        assert got.usage.completion_tokens == sum(len(e.token_ids) for e in expected), case
        assert any(e.finish_reason == "stop" for e in expected), f"{case}: no sample met a stop string"


def test_models_tokenize_detokenize_version_metrics(server, smollm2):
    models = HTTP.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "smollm2"
    assert models["data"][0]["max_model_len"] == server.engine.max_model_len
    ids = _post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert ids["tokens"] == smollm2.tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == smollm2.render_chat([{"role": "user", "content": "hi"}])
    text = _post(server, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    assert HTTP.get(server.url + "/version", headers=AUTH).json()["version"]
    assert HTTP.get(server.url + "/health").status_code == 200
    metrics = HTTP.get(server.url + "/metrics", headers=AUTH).text
    for name in ("ridge:num_requests_running", "ridge:num_requests_waiting", "ridge:kv_cache_usage_perc",
                 "ridge:prompt_tokens_total", "ridge:generation_tokens_total", "ridge:num_preemptions_total",
                 "ridge:time_to_first_token_seconds_bucket", "ridge:inter_token_latency_seconds_bucket",
                 "ridge:e2e_request_latency_seconds_bucket", "ridge:request_queue_time_seconds_bucket",
                 "ridge:request_prompt_tokens_bucket", "ridge:request_generation_tokens_bucket"):
        assert name in metrics, name
    success = [line for line in metrics.splitlines() if line.startswith("ridge:request_success_total")]
    assert any('finished_reason="length"' in line and float(line.split()[-1]) > 0 for line in success)


def test_prefix_cache_usage_salt_and_metrics(client, server):
    system = "You are ridge's test assistant. Answer in one short sentence, politely and precisely. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
    again = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
    assert again.choices[0].message.content == first.choices[0].message.content
    prompt_blocks = (first.usage.prompt_tokens - 1) // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_blocks > 0
    salted = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4,
                                            extra_body={"cache_salt": "tenant-7"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    streamed = list(client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == prompt_blocks
    _assert_error(_post(server, CHAT, {**OK_BODY, "cache_salt": ""}), 400, "cache_salt")
    metrics = HTTP.get(server.url + "/metrics", headers=AUTH).text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("ridge:prefix_cache")}
    assert values["ridge:prefix_cache_hits_total"] >= 2 * prompt_blocks
    assert values["ridge:prefix_cache_queries_total"] >= values["ridge:prefix_cache_hits_total"]
    assert 0 < values["ridge:prefix_cache_hit_rate"] <= 1 and "ridge:prefix_cache_evictions_total" in values


def test_beam_search_through_the_server_equals_llm_beam_search(client, server, smollm2):
    prompts = ["The capital of France is", "def add(a, b):"]
    expected = smollm2.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8))
    got = client.completions.create(model="smollm2", prompt=prompts, max_tokens=8, n=2,
                                    extra_body={"use_beam_search": True, "beam_width": 3})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for i, result in enumerate(expected):
        best = result.sequences[:2]
        assert [c.text for c in got.choices[2 * i: 2 * i + 2]] == [h.text for h in best]
        assert [c.finish_reason for c in got.choices[2 * i: 2 * i + 2]] == [
            "stop" if h.finished else "length" for h in best]
    assert got.usage.completion_tokens == sum(len(h.token_ids) for r in expected for h in r.sequences[:2])

    messages = [{"role": "user", "content": "Name a fruit."}]
    (chat_expected,) = smollm2.beam_search([smollm2.tokenizer.encode_chat(messages)],
                                           BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5))
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, stream=True,
                                                 extra_body={"use_beam_search": True, "beam_width": 2,
                                                             "length_penalty": 0.5}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_expected.sequences[0].text

    _assert_error(_post(server, CHAT, {**OK_BODY, "use_beam_search": True, "n": 3, "beam_width": 2}), 400, "n")
    _assert_error(_post(server, CHAT, {**OK_BODY, "use_beam_search": True, "beam_width": 11}), 400, "beam_width")
    _assert_error(_post(server, CHAT, {**OK_BODY, "use_beam_search": True, "stop": ["."]}), 400, "stop")
    assert _post(server, CHAT, OK_BODY).status_code == 200


def _post(server, path: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None = None, text: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if text is not None:
        assert text in error["message"], error


CHAT = "/v1/chat/completions"
OK_BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


@pytest.mark.parametrize(("body", "param"), [
    ({**OK_BODY, "temperature": -1}, "temperature"),
    ({**OK_BODY, "top_p": 1.5}, "top_p"),
    ({**OK_BODY, "max_tokens": 0}, "max_tokens"),
    ({**OK_BODY, "n": 0}, "n"),
    ({**OK_BODY, "logit_bias": {"99999999": 5}}, "logit_bias"),
    ({**OK_BODY, "top_logprobs": 50, "logprobs": True}, "logprobs"),
    ({"max_tokens": 4}, "messages"),
    ({**OK_BODY, "temperature": "hot"}, "temperature"),
])
def test_invalid_fields_get_400_naming_the_field(server, body, param):
    _assert_error(_post(server, CHAT, body), 400, param)
    assert _post(server, CHAT, OK_BODY).status_code == 200


def test_context_overflow_and_empty_prompt(server):
    long_prompt = "hello " * (server.engine.max_model_len + 10)
    _assert_error(_post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4}), 400,
                  text="maximum context length")
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}), 400,
                  text="maximum context length")
    _assert_error(_post(server, "/v1/completions", {"prompt": "", "max_tokens": 4}), 400, "prompt")
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4}).status_code == 200


def test_unknown_model_oversized_body_and_auth(server):
    _assert_error(_post(server, CHAT, {**OK_BODY, "model": "gpt-17"}), 404, "model")
    huge = {**OK_BODY, "messages": [{"role": "user", "content": "x" * 100_000}]}
    _assert_error(_post(server, CHAT, huge), 413)
    _assert_error(_post(server, CHAT, OK_BODY, headers={}), 401)
    _assert_error(_post(server, CHAT, OK_BODY, headers={"Authorization": "Bearer wrong"}), 401)
    assert _post(server, CHAT, OK_BODY).status_code == 200


def test_full_queue_gets_429(server):
    server.engine.max_waiting = 0
    try:
        _assert_error(_post(server, CHAT, OK_BODY), 429)
    finally:
        server.engine.max_waiting = 256
    assert _post(server, CHAT, OK_BODY).status_code == 200


def test_internal_errors_do_not_leak(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internals at /src/ridge/x.py line 12")

    monkeypatch.setattr(server.engine.tokenizer, "encode_chat", broken)
    response = _post(server, CHAT, OK_BODY)
    _assert_error(response, 500)
    assert "secret" not in response.text
    monkeypatch.undo()
    assert _post(server, CHAT, OK_BODY).status_code == 200


def test_speculative_server_reports_its_drafts(smollm2_path, smollm2):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="128MiB", speculate="ngram",
                          speculation_policy="fixed")
    srv = make_server(config, ServerConfig("smollm2"), port=free_port(), log_level="warning", progress=False)
    thread = start_in_thread(srv)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,"
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
        expected = smollm2.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
        assert got.choices[0].text == expected
        spec = got.usage.model_extra["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
        metrics = HTTP.get(srv.url + "/metrics").text
        values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("ridge:spec_decode") or line.startswith("ridge:generation_tokens_total")}
        assert values["ridge:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]
        assert values["ridge:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
        assert values["ridge:generation_tokens_total"] == got.usage.completion_tokens
        assert values["ridge:spec_decode_draft_acceptance_rate"] == pytest.approx(spec["acceptance_rate"])
    finally:
        srv.uvicorn.should_exit = True
        thread.join(timeout=30)


def test_a_priority_server_serves_an_urgent_request_before_a_running_one(smollm2_path, smollm2):
    """--schedule-policy priority with room for one sequence: a request of priority -1 displaces the running one of
    priority 0 and is answered while that one still streams (under fcfs it would wait for all 40 of its tokens);
    the displaced one then finishes with its own greedy tokens."""
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB",
                          schedule_policy="priority", max_num_seqs=1)
    body = {"model": "smollm2", "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with running_server(config, ServerConfig("smollm2")) as srv:
        async def both() -> tuple[list[int], list[int], bool]:
            streamed: list[int] = []
            started = asyncio.Event()
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                async def background() -> None:
                    async with http.stream("POST", "/v1/completions",
                                           json={**body, "max_tokens": 40, "stream": True}) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                streamed.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                                started.set()

                task = asyncio.create_task(background())
                await started.wait()
                urgent = await http.post("/v1/completions", json={**body, "max_tokens": 4, "priority": -1})
                still_streaming = not task.done()
                await task
            return urgent.json()["choices"][0]["token_ids"], streamed, still_streaming

        urgent, streamed, still_streaming = asyncio.run(both())
        assert still_streaming, "the urgent request waited for the running one"
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
        assert streamed == smollm2.generate("Once upon a time", params)[0].outputs[0].token_ids
        assert urgent == streamed[:4]
        metrics = HTTP.get(srv.url + "/metrics").text
        assert re.search(r'^ridge:num_preemptions_total\{[^}]*\} [1-9]', metrics, re.M), "no preemption counted"


def test_health_reports_a_dead_engine(server):
    server.engine.error = RuntimeError("simulated")
    try:
        assert HTTP.get(server.url + "/health").status_code == 503
        _assert_error(_post(server, CHAT, OK_BODY), 503)
    finally:
        server.engine.error = None
    assert HTTP.get(server.url + "/health").status_code == 200


def test_an_engine_that_cannot_start_says_why(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), kv_cache_memory="1KiB")
    with pytest.raises(RuntimeError, match="kv_cache_memory"):
        make_server(config, ServerConfig("smollm2"), port=free_port(), progress=False)


def test_disconnected_streams_free_their_blocks(server):
    body = {**OK_BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(4):
            with http.stream("POST", server.url + CHAT, json=body, headers=AUTH) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for _ in range(6):
                    next(lines)
            # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while (state := server.engine.state()).num_free_blocks != state.num_blocks:
        assert time.monotonic() < deadline, f"{state.num_blocks - state.num_free_blocks} blocks still held"
        time.sleep(0.01)
    assert _post(server, CHAT, OK_BODY).status_code == 200


def test_64_concurrent_streams_all_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="smollm2", prompt=f"Story number {i}:", max_tokens=8 + i % 5, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main() -> list[int]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(main()) == [8 + i % 5 for i in range(64)]


def test_sigterm_finishes_in_flight_requests_and_exits_0(smollm2_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ridge.cli", "serve", "--model", str(smollm2_path), "--port",
                             str(port), "--kv-cache-memory", "128MiB", "--grace", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if HTTP.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "Count:", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1]]
        assert finish[-1] == "length", "the in-flight request was cut short"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_serve_load_generator(server):
    """`ridge bench serve`'s client against this server: every request counted, the SLO arithmetic right."""
    from ridge.bench import serve as bench_serve
    from ridge.bench.workloads import random_requests

    requests = random_requests(server.engine.tokenizer.vocab_size, 12, 20, 6, seed=1)
    results, duration = asyncio.run(bench_serve.run_load(
        server.url, "smollm2", requests, request_rate=50.0, max_concurrency=4, ignore_eos=True, seed=0,
        api_key=KEY, progress=False))
    report = bench_serve.summarize(results, duration, {"ttft": 1e9, "tpot": 1e9})
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == 12 * 6
    assert report["goodput"] == pytest.approx(report["request_throughput"])
    assert 0 < report["ttft"]["median_ms"] <= report["ttft"]["p99_ms"] <= report["e2el"]["p99_ms"]
    strict = bench_serve.summarize(results, duration, {"ttft": 0.0})
    assert strict["goodput"] == 0
    with pytest.raises(ValueError, match="--goodput"):
        bench_serve.parse_goodput(["latency:5"])
    assert bench_serve.parse_targets(["ridge=http://a:1", "http://b:2/"]) == [("ridge", "http://a:1"),
                                                                             ("b:2", "http://b:2/")]
    with pytest.raises(ValueError, match="--base-url"):
        bench_serve.parse_targets(["vllm=localhost:8000"])


def test_bench_multiturn_sessions_reuse_the_cache(server):
    """A multiturn session's turns go one after another, so each finds the previous turn's prompt cached."""
    from ridge.bench import serve as bench_serve
    from ridge.bench.workloads import multiturn

    requests = multiturn(server.engine.tokenizer, 2, max_turns=3, max_prompt_len=1024, max_output_len=8)
    assert len({r.session for r in requests}) == 2 and len(requests) >= 4
    for earlier, later in zip(requests, requests[1:], strict=False):
        if earlier.session == later.session:
            assert later.prompt_ids[: len(earlier.prompt_ids) - 8] == earlier.prompt_ids[:-8]
    results, duration = asyncio.run(bench_serve.run_load(
        server.url, "smollm2", requests, request_rate=float("inf"), max_concurrency=None, ignore_eos=True, seed=0,
        api_key=KEY, progress=False))
    report = bench_serve.summarize(results, duration, {})
    assert report["completed"] == len(requests)
    later_turns = [res for r, res, prev in zip(requests[1:], results[1:], requests, strict=False)
                   if r.session == prev.session]
    assert later_turns and all(res.cached_tokens >= 16 for res in later_turns)
    assert 0 < report["prefix_cache_hit_rate"] < 1


def test_bench_chat_turns_repeat_the_server_s_own_replies(server, smollm2):
    """The chat workload's later turns send the conversation so far with the replies the server gave, so each finds
    all but the last partial block of it cached; the replies are the engine's greedy continuations."""
    from ridge.bench import serve as bench_serve
    from ridge.bench.workloads import chat_requests

    requests = chat_requests(server.engine.tokenizer.vocab_size, 2, max_turns=3, input_len=20, output_len=12, seed=4)
    assert [(r.session, r.continues) for r in requests] == [(0, False), (0, True), (0, True),
                                                            (1, False), (1, True), (1, True)]
    results, duration = asyncio.run(bench_serve.run_load(
        server.url, "smollm2", requests, request_rate=float("inf"), max_concurrency=None, ignore_eos=True, seed=0,
        api_key=KEY, progress=False))
    assert bench_serve.summarize(results, duration, {})["completed"] == 6
    by_turn = bench_serve.ttft_by_turn(requests, results)
    assert list(by_turn) == [1, 2, 3]
    assert by_turn[2] == pytest.approx((results[1].ttft_s + results[4].ttft_s) / 2 * 1e3)
    for session in (0, 1):
        first, second, third = results[3 * session:3 * session + 3]
        assert second.prompt_len == first.prompt_len + 12 + 20 and third.prompt_len == second.prompt_len + 12 + 20
        assert third.token_ids is None  # the last turn's reply is repeated by nothing
        conversation = requests[3 * session].prompt_ids
        greedy = smollm2.generate([conversation], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert first.token_ids == greedy[0].outputs[0].token_ids
        for turn in (second, third):  # the conversation so far, less the reply's last token (never computed)
            assert turn.cached_tokens == (turn.prompt_len - 20 - 1) // 16 * 16


def test_bench_serve_command(server, smollm2_path, tmp_path):
    """`ridge bench serve` as a user runs it, against this server: the report saved, every request served."""
    from ridge.cli import main

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", f"ridge={server.url}", "--model", str(smollm2_path), "--api-key", KEY,
                 "--served-model-name", "smollm2", "--workload", "random", "--num-prompts", "6", "--input-len", "16",
                 "--output-len", "4", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 6 and run["failed"] == 0 and run["total_output_tokens"] == 6 * 4, run


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_streaming_and_not(client):
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=64,
                                           response_format=response_format)
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=64,
                                            response_format=response_format, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_openai_parse_and_vllm_fields(client):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "A person?"}],
                                           temperature=0, max_tokens=64, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    choices = ["red", "green", "blue"]
    out = client.completions.create(model="smollm2", prompt="My favourite colour is", temperature=0, max_tokens=8,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    out = client.completions.create(model="smollm2", prompt="The year was", temperature=0, max_tokens=8,
                                    extra_body={"structured_outputs": {"regex": " [12][0-9]{3}"}})
    assert re.fullmatch(r" [12][0-9]{3}", out.choices[0].text)
    # vLLM's structural tag: free text until the trigger (which the model writes here), then its structure
    tag = {"type": "structural_tag", "triggers": [" Paris"],
           "structures": [{"begin": " Paris", "schema": {"enum": [1, 2, 3]}, "end": "!"}]}
    out = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=12,
                                    extra_body={"response_format": tag})
    assert re.match(r" Paris *[123] *!", out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": PERSON, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f>"],
                          "structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}]}}, "response_format"),
    ({"structural_tag": "[]"}, "structural_tag"),
    ({"response_format": {"type": "json_object", "triggers": ["<f>"]}}, "response_format.triggers"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f>"],
                          "structures": [{"begin": "<f>", "schema": {}, "end": "", "tag": "x"}]}},
     "response_format.structures.0.tag"),
])
def test_bad_constraints_get_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ({"chat_template": "{{ messages }}"}, "chat_template"),  # this server does not trust a request's template
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),  # a variable the request's fields set
    ({"best_of": 3}, "best_of"),  # chat completions do not rank samples
    ({"suffix": "x"}, "suffix"),  # a completions field
    ({"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, "echo"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),  # no usage
    ({"documents": [{"title": "a", "text": "b"}]}, "documents"),  # SmolLM2's template does not read them
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),  # past the context
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),  # no JSON constraint to shape
    ({"guided_whitespace_pattern": " *", "guided_regex": "a+"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"guided_whitespace_pattern": " ", "structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": ""}},
     "structured_outputs.whitespace_pattern"),  # two whitespace rules
    ({"structured_outputs": {"regex": "a+", "whitespace": "x"}}, "structured_outputs.whitespace"),  # no such key
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"include_reasoning": False}, "include_reasoning"),  # no --reasoning-parser: the reply is all content
    ({"priority": 1}, "priority"),  # the server schedules by lpm: every request is equal there
])
def test_fields_not_implemented_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(client, smollm2):
    """vLLM's truncate_prompt_tokens: the reply to a prompt cut to its last 12 tokens is the reply to those 12
    tokens (usage and echo count and show what the model read); -1 keeps what the context holds; a chat's rendered
    conversation is cut the same way. Refused with a fill-in-the-middle suffix."""
    text = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do"
    ids = smollm2.tokenizer.encode(text)
    assert len(ids) > 12
    cut = client.completions.create(model="smollm2", prompt=text, temperature=0, max_tokens=8, echo=True,
                                    extra_body={"truncate_prompt_tokens": 12, "ignore_eos": True})
    alone = client.completions.create(model="smollm2", prompt=ids[-12:], temperature=0, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    echoed = smollm2.tokenizer.decode(ids[-12:])
    assert cut.choices[0].text == echoed + alone.choices[0].text and cut.usage.prompt_tokens == 12
    whole = client.completions.create(model="smollm2", prompt=text, temperature=0, max_tokens=8,
                                      extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True})
    assert whole.usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=8,
                                          extra_body={"truncate_prompt_tokens": 9, "ignore_eos": True})
    rendered = smollm2.tokenizer.encode_chat(messages)
    plain = client.completions.create(model="smollm2", prompt=rendered[-9:], temperature=0, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == 9 and chat.choices[0].message.content == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2", prompt="def f(", suffix="return 1", max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert caught.value.body["param"] in ("truncate_prompt_tokens", "suffix"), caught.value.body


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client):
    """vLLM's return_tokens_as_token_ids: every token of the logprobs, chosen and alternative, is "token_id:<id>",
    the chosen ones the reply's own ids; a chat logprob's bytes stay its token's text's."""
    out = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=6,
                                    logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                            "return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in choice.logprobs.top_logprobs for k in top)
    plain = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                      max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    assert choice.logprobs.text_offset == plain.choices[0].logprobs.text_offset
    assert choice.logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, max_tokens=5, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content, ids = chat.choices[0].logprobs.content, chat.choices[0].token_ids
    texts = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0, max_tokens=5, logprobs=True).choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in ids]
    assert [c.bytes for c in content] == [c.bytes for c in texts]
    assert all(re.fullmatch(r"token_id:\d+", alt.token) for c in content for alt in c.top_logprobs)


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens generated up to it; the
    last of them is the final usage (both endpoints)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            temperature=0, max_tokens=12, stream=True, stream_options=options)
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == chunks[-1].usage.completion_tokens
    assert len(counts) > 1 and all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    stream = client.completions.create(model="smollm2", prompt="Once upon a time", temperature=0, max_tokens=10,
                                       stream=True, stream_options=options, extra_body={"ignore_eos": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices]
    assert counts == list(range(1, 11))


def test_whitespace_rules_shape_a_json_constraint_s_whitespace(client):
    """vLLM's guided_whitespace_pattern, and structured_outputs' whitespace_pattern and disable_any_whitespace: a
    JSON reply's whitespace between tokens held to the pattern (none here), where without one the model spaces its
    JSON out."""
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    def reply(body):
        return client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=60,
                                              extra_body=body).choices[0].message.content

    def compact(text):
        return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text

    assert not compact(reply(schema))  # the check can fail
    assert compact(reply({**schema, "guided_whitespace_pattern": ""}))
    for option in ({"whitespace_pattern": ""}, {"disable_any_whitespace": True}):
        assert compact(reply({"structured_outputs": {"json": PERSON, **option}}))


def test_disable_additional_properties_closes_every_object_of_the_schema(client):
    """structured_outputs.disable_additional_properties: each object of the schema, nested ones too, takes only the
    keys it names (additionalProperties false where the schema does not say), where without it the model adds its
    own; a property that is itself named "properties" stays a property."""
    from ridge.serve.protocol import _closed_objects

    nested = {"type": "object", "properties": {"properties": {"type": "string"}, "pet": {
        "type": "object", "properties": {"name": {"type": "string"}}}}, "$defs": {"x": {"properties": {}}},
        "additionalProperties": True}
    closed = _closed_objects(nested)
    assert closed["additionalProperties"] is True and closed["properties"]["properties"] == {"type": "string"}
    assert closed["properties"]["pet"]["additionalProperties"] is False
    assert closed["$defs"]["x"]["additionalProperties"] is False
    only_name = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}}
    messages = [{"role": "user", "content": "Describe a person as JSON with their name, age and city."}]

    def keys(disable):
        text = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=60,
                                              extra_body={"structured_outputs": {
                                                  "json": only_name, "disable_additional_properties": disable,
                                                  "whitespace_pattern": " ?"}}).choices[0].message.content
        return set(json.loads(text))

    assert keys(False) - {"name"}  # the check can fail
    assert keys(True) <= {"name"}


def test_chat_echo_opens_the_reply_with_the_assistant_message_it_continues(client):
    """vLLM's chat echo: where the last message is the assistant's (a reply continued), the reply's content opens
    with it, streamed or not; after a user's message there is nothing to echo."""
    messages = [{"role": "user", "content": "Name a city."},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    ask = dict(model="smollm2", messages=messages, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**ask, extra_body=body).choices[0].message.content
    echoed = client.chat.completions.create(**ask, extra_body={**body, "echo": True}).choices[0].message.content
    assert plain and echoed == "The capital of France is" + plain
    chunks = client.chat.completions.create(**ask, stream=True, extra_body={**body, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    user_last = dict(ask, messages=messages[:1])
    assert (client.chat.completions.create(**user_last, extra_body={"echo": True}).choices[0].message.content
            == client.chat.completions.create(**user_last).choices[0].message.content)


def test_fields_that_ask_nothing_pass(client):
    """What clients send by default (tool_choice none, empty lists, best_of = n, a user label) changes nothing."""
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, user="someone",
                                         extra_body={"tool_choice": "none", "tools": [], "best_of": 1,
                                                     "priority": 0})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_echo_with_logprobs_scores_the_prompt_as_one_pass_does(client, smollm2):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1 or 0), and vLLM's prompt_logprobs: the
    prompt's logprobs equal the engine's whole-prompt logits."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = smollm2.tokenizer.encode(prompt)
    logp = smollm2.engine.prompt_logits(ids).log_softmax(dim=-1)
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    for max_tokens in (1, 0):
        out = client.completions.create(model="smollm2", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
                                        temperature=0)
        lp, choice = out.choices[0].logprobs, out.choices[0]
        assert len(lp.tokens) == len(ids) + max_tokens and out.usage.completion_tokens == max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(abs(a - b) < 2e-4 for a, b in zip(lp.token_logprobs[1:len(ids)], expected, strict=True))
        assert all(t in top and len(top) <= 2 for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
        assert choice.text.startswith(prompt) and (max_tokens or choice.text == prompt)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    for stream in (False, True):
        reply = HTTP.post(f"{client.base_url}completions", headers=AUTH, json={**body, "stream": stream})
        if stream:
            events = [json.loads(line[6:]) for line in reply.text.splitlines() if line[6:].startswith("{")]
            scored = [c["prompt_logprobs"] for e in events for c in e["choices"] if "prompt_logprobs" in c]
            assert len(scored) == 1  # once, with the choice's first chunk
            entries = scored[0]
        else:
            entries = reply.json()["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        got = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)]
        assert all(abs(a - b) < 2e-4 for a, b in zip(got, expected, strict=True))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_return_token_ids_gives_the_prompt_s_and_the_reply_s_ids(client, smollm2):
    """vLLM's return_token_ids: the ids equal the engine's greedy tokens and the prompt's encoding, whole or over a
    stream's chunks, on both endpoints; absent when not asked."""
    prompt = "The capital of France is"
    ids = smollm2.tokenizer.encode(prompt)
    greedy = smollm2.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    asks = {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
    body = {"prompt": prompt, **asks}
    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = smollm2.tokenizer.encode_chat(messages)
    chat_greedy = smollm2.generate([chat_ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    for stream in (False, True):
        reply = HTTP.post(f"{client.base_url}completions", headers=AUTH, json={**body, "stream": stream})
        chat = HTTP.post(f"{client.base_url}chat/completions", headers=AUTH,
                         json={**asks, "messages": messages, "stream": stream})
        if stream:
            events = [json.loads(line[6:]) for line in reply.text.splitlines() if line[6:].startswith("{")]
            choices = [c for e in events for c in e["choices"]]
            assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [ids]  # the first chunk
            assert [t for c in choices for t in c["token_ids"]] == greedy
            events = [json.loads(line[6:]) for line in chat.text.splitlines() if line[6:].startswith("{")]
            assert [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e] == [chat_ids]
            assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == chat_greedy
        else:
            (choice,) = reply.json()["choices"]
            assert choice["prompt_token_ids"] == ids and choice["token_ids"] == greedy
            assert chat.json()["prompt_token_ids"] == chat_ids and chat.json()["choices"][0]["token_ids"] == chat_greedy
    plain = HTTP.post(f"{client.base_url}completions", headers=AUTH, json={**body, "return_token_ids": False})
    assert "token_ids" not in plain.json()["choices"][0] and "prompt_token_ids" not in plain.json()["choices"][0]


def test_best_of_returns_the_likeliest_of_its_samples(client):
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3, logprobs=0)
    drawn = client.completions.create(n=4, **kwargs)
    best = client.completions.create(n=2, extra_body={"best_of": 4}, **kwargs)
    ranked = sorted(drawn.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked] and [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == drawn.usage.completion_tokens  # every sample drawn counts
    hidden = client.completions.create(n=1, extra_body={"best_of": 2}, **{**kwargs, "logprobs": None})
    assert hidden.choices[0].logprobs is None  # ranked by logprobs, which were not asked to be shown
    for extra, param in (({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of")):
        reply = HTTP.post(f"{client.base_url}completions", headers=AUTH, json={"prompt": "Hi", **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_allowed_token_ids_and_bad_words(client, smollm2):
    prompt = "The capital of France is"
    allowed = [smollm2.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=1.0, seed=0,
                                    extra_body={"allowed_token_ids": allowed})
    assert out.choices[0].text and out.choices[0].text.replace(" yes", "").replace(" no", "") == ""
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0)
    assert "Paris" in plain.choices[0].text
    banned = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text and banned.choices[0].text != plain.choices[0].text


def test_tokenizer_info_one_model_and_unknown_routes(server):
    info = HTTP.get(server.url + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "<|im_end|>" and "{%" in info["chat_template"]
    card = HTTP.get(server.url + "/v1/models/smollm2", headers=AUTH).json()
    assert card["id"] == "smollm2" and card["object"] == "model"
    _assert_error(HTTP.get(server.url + "/v1/models/gpt-4", headers=AUTH), 404, "model")
    missing = HTTP.post(server.url + "/v1/images/generations", headers=AUTH, json={"prompt": "hi"})
    _assert_error(missing, 404, text="POST /v1/completions")  # the envelope lists what the server answers
    _assert_error(HTTP.get(server.url + "/v1/completions", headers=AUTH), 405)


def test_chat_stream_opens_each_choice_with_its_first_token(client):
    """The role comes with a choice's first token, as vLLM sends it: a client timing its first chunk times the
    prefill, not an empty chunk sent before it."""
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Name a fruit."}],
                                            max_tokens=8, temperature=0.7, seed=1, n=2, stream=True)
    by_choice: dict[int, list] = {}
    for chunk in stream:
        for choice in chunk.choices:
            by_choice.setdefault(choice.index, []).append(choice.delta)
    assert sorted(by_choice) == [0, 1]
    for deltas in by_choice.values():
        assert deltas[0].role == "assistant" and deltas[0].content  # the role rides on the first token's text
        assert all(d.role is None for d in deltas[1:])


def test_tools_are_refused_where_the_template_has_no_call_format(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       tools=[tool])
    assert caught.value.body["param"] == "tools"
