"""No request can take the server down: the attacks and careless inputs of issue 41 as regression tests.

Each bad request must get a 4xx in OpenAI's envelope naming the field, and a good request right after
it must be served; the module's server checks its KV accounting after every test (conftest's
_server_idle_and_whole), so an input that leaks a block fails the test that sent it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import HTTP
from ridge.config import EngineConfig
from ridge.engine.supervision import Supervision
from ridge.serve.app import ServerConfig
from ridge.serve.server import free_port, make_server, start_in_thread

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
OK_COMPLETION = {"prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    srv = make_server(config, ServerConfig("smollm2", api_key=KEY, max_n=16, max_request_tokens=4096),
                      port=free_port(), log_level="warning", progress=False)
    thread = start_in_thread(srv)
    yield srv
    srv.uvicorn.should_exit = True
    thread.join(timeout=30)


def post(server, path: str, body=None, headers=None, content: bytes | None = None, timeout=60) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if content is not None:
        return HTTP.post(server.url + path, content=content, headers=headers, timeout=timeout)
    return HTTP.post(server.url + path, json=body, headers=headers, timeout=timeout)


def raw_json(server, path: str, text: str) -> httpx.Response:
    """A body as the client wrote it: JSON text that Python's json.dumps would not produce (Infinity, lone
    surrogate escapes)."""
    return post(server, path, headers={"Content-Type": "application/json"}, content=text.encode())


def assert_refused(response: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serving(server) -> None:
    response = post(server, CHAT, OK_CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("path", "text", "param"), [
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "top_k": 1180591620717411303424}', "top_k"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "top_k": 49153}', "top_k"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "seed": 1180591620717411303424}', "seed"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "temperature": Infinity}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "temperature": 1e308}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "repetition_penalty": Infinity}', "repetition_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "presence_penalty": -Infinity}', "presence_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [49152]}', "stop_token_ids"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1]}', "stop_token_ids"),
    (COMPLETIONS, '{"prompt": [[false]], "max_tokens": 4}', "prompt"),
    (COMPLETIONS, '{"prompt": [true, 5], "max_tokens": 4}', "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "n": 100000}', "n"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 1000, "n": 8}', "max_tokens"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "logprobs": 21}', "logprobs"),
    (COMPLETIONS, '{"prompt": "hi \\ud800", "max_tokens": 4}', "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "stop": ["\\udfff"]}', "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}', "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 4}',
     "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}], "max_tokens": 4}',
     "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages.0.content.0.type"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}], "max_tokens": 4}', "messages.0"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_logprobs": 2}', "top_logprobs"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 17}', "n"),
    ("/tokenize", '{"prompt": "hi \\ud800"}', "prompt"),
    ("/tokenize", '{"messages": []}', "messages"),
    ("/detokenize", '{"tokens": [true]}', "tokens.0"),
    ("/detokenize", '{"tokens": [49152]}', "tokens"),
])
def test_bad_fields_get_400_naming_the_field(server, path, text, param):
    error = assert_refused(raw_json(server, path, text), 400)
    assert error["param"] == param or (error["param"] or "").startswith(param), error
    assert_serving(server)


def test_tiny_temperature_samples_the_most_likely_token(server):
    """1e-39 is a valid temperature: it must sample (as greedy does, to the last bit), not return nothing."""
    greedy = post(server, COMPLETIONS, {**OK_COMPLETION, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    tiny = raw_json(server, COMPLETIONS, '{"prompt": "hi", "max_tokens": 8, "temperature": 1e-39, '
                                         '"ignore_eos": true, "seed": 3}')
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert tiny.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(("content", "headers", "status", "param"), [
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', {"Content-Type": "application/json"}, 400, None),
    (b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}, 400, None),
    (b"[" * 20_000 + b"]" * 20_000, {"Content-Type": "application/json"}, 400, None),
    (b"not json at all", {"Content-Type": "application/json"}, 400, None),
    (b'{"prompt": "hi"', {"Content-Type": "application/json"}, 400, None),
    (b'{"prompt": "hi", "max_tokens": 4}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
    (b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
])
def test_unreadable_bodies_get_the_envelope(server, content, headers, status, param):
    response = HTTP.post(server.url + COMPLETIONS, content=content, headers={**AUTH, **headers}, timeout=60)
    assert_refused(response, status, param)
    assert_serving(server)


def test_unknown_routes_and_methods_get_the_envelope(server):
    assert_refused(HTTP.get(server.url + "/v1/nothing", headers=AUTH), 404)
    assert_refused(HTTP.get(server.url + CHAT, headers=AUTH), 405)


def test_the_openapi_schema_states_what_the_server_answers(server):
    schema = HTTP.get(server.url + "/openapi.json", headers=AUTH).json()
    chat = schema["paths"][CHAT]["post"]["responses"]
    assert "422" not in chat
    assert {"200", "400", "401", "404", "413", "415", "429", "500", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorResponse"
    # and it does answer 400 where the schema says so (a missing field)
    assert_refused(post(server, CHAT, {"max_tokens": 4}), 400, "messages")


def test_the_api_key_guards_every_route_but_health(server):
    routes = [("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "a"}),
              ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/metrics", None), ("GET", "/docs", None),
              ("GET", "/openapi.json", None), ("GET", "/version", None), ("POST", CHAT, OK_CHAT),
              ("POST", COMPLETIONS, OK_COMPLETION)]
    for method, path, body in routes:
        assert_refused(HTTP.request(method, server.url + path, json=body), 401)
        assert_refused(HTTP.request(method, server.url + path, json=body, headers={"Authorization": "Bearer no"}), 401)
        assert HTTP.request(method, server.url + path, json=body, headers=AUTH, timeout=60).status_code == 200, path
    assert HTTP.get(server.url + "/health").status_code == 200


def test_metrics_no_auth_opens_metrics_only(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="16MiB")
    srv = make_server(config, ServerConfig("smollm2", api_key=KEY, metrics_no_auth=True), port=free_port(),
                      log_level="warning", progress=False)
    thread = start_in_thread(srv)
    try:
        assert HTTP.get(srv.url + "/metrics").status_code == 200
        assert_refused(HTTP.post(srv.url + "/tokenize", json={"prompt": "hi"}), 401)
    finally:
        srv.uvicorn.should_exit = True
        thread.join(timeout=30)


def test_queued_work_over_the_server_s_limit_gets_429(server):
    server.engine.max_queued_tokens = 100
    try:
        assert_refused(post(server, CHAT, {**OK_CHAT, "max_tokens": 200}), 429)
        assert post(server, CHAT, {**OK_CHAT, "max_tokens": 4}).status_code == 200  # 4 + prompt fits
    finally:
        server.engine.max_queued_tokens = None


def test_a_client_that_leaves_a_plain_request_aborts_it(server):
    body = {**OK_COMPLETION, "max_tokens": 1400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, COMPLETIONS, body, timeout=1.0)
    deadline = time.monotonic() + 10
    while not (state := server.engine.state()).idle or state.num_free_blocks != state.num_blocks:
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.05)
    assert server.engine.num_unfinished == 0


def _wait_health(url: str, status: int, timeout_s: float) -> float:
    start = time.monotonic()
    while True:
        try:
            if HTTP.get(url + "/health", timeout=2).status_code == status:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        assert time.monotonic() - start < timeout_s, f"/health did not answer {status} within {timeout_s} s"
        time.sleep(0.1)


def test_a_killed_engine_is_restarted_and_its_requests_fail_fast(smollm2_path):
    """SIGKILL the engine process mid-load: the requests it held get an error within 5 s, the server
    restarts it (503 + Retry-After meanwhile), and the next requests are served. Past --engine-restarts
    the server exits 1."""
    config = EngineConfig(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory="32MiB")
    srv = make_server(config, ServerConfig("smollm2"), port=free_port(), log_level="warning", progress=False,
                      supervision=Supervision(max_restarts=1))
    thread = start_in_thread(srv)
    try:
        import concurrent.futures

        body = {**OK_COMPLETION, "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, srv.url + COMPLETIONS, json=body, timeout=60) for _ in range(4)]
            deadline = time.monotonic() + 30
            while srv.engine.num_unfinished < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
            first_pid = srv.engine.pid
            os.kill(first_pid, signal.SIGKILL)
            killed = time.monotonic()
            responses = [f.result() for f in futures]
            failed_within = time.monotonic() - killed
        assert failed_within < 5, failed_within
        for response in responses:
            assert_refused(response, 503)
        health = HTTP.get(srv.url + "/health")
        if health.status_code == 503:
            assert health.json()["status"] == "restarting" and int(health.headers["Retry-After"]) >= 1
            refused = HTTP.post(srv.url + COMPLETIONS, json=OK_COMPLETION, timeout=60)
            if refused.status_code == 503:
                assert int(refused.headers["Retry-After"]) >= 1
        _wait_health(srv.url, 200, 30)
        assert srv.engine.pid != first_pid
        served = HTTP.post(srv.url + COMPLETIONS, json=OK_COMPLETION, timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        state = srv.engine.state()
        assert state.idle and state.num_free_blocks == state.num_blocks and state.integrity_error is None

        os.kill(srv.engine.pid, signal.SIGKILL)  # the one restart is spent: the server gives up and exits 1
        thread.join(timeout=30)
        assert not thread.is_alive() and srv.exit_code == 1
    finally:
        srv.uvicorn.should_exit = True
        thread.join(timeout=30)


def test_sigterm_exits_within_the_grace_period_while_the_engine_is_busy(smollm2_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ridge.cli", "serve", "--model", str(smollm2_path), "--port",
                             str(port), "--kv-cache-memory", "128MiB", "--grace", "2"],  # 2,800 tokens in float32
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, 200, 120)
        body = {"prompt": "Count:", "max_tokens": 2800, "ignore_eos": True, "stream": True, "n": 4}
        with HTTP.stream("POST", url + COMPLETIONS, json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            rest = list(lines)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 2 + 8, "SIGTERM took longer than the grace period and a few seconds"
        # the request could not finish in the grace period: it ends with an error event, not a cut connection
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 503 and "shutting down" in events[-1]["error"]["message"]
        assert [line for line in rest if line][-1] == "data: [DONE]"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    orphans = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert not orphans, f"processes left behind: {orphans}"


def test_a_failing_step_ends_its_requests_and_the_core_serves_on(smollm2_path, monkeypatch):
    """The core's loop (run in this process, over a real pipe) with a sampler that fails on one request's
    rows: that request gets StepFailed, the other finishes, and the KV accounting holds."""
    import multiprocessing
    import threading

    from ridge import SamplingParams
    from ridge.engine import engine_core
    from ridge.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="16MiB"),
                       progress=False)
    real = engine.sampler.__call__

    def flaky(logits, seqs):
        if any(s.request_id == "poison" for s in seqs):
            raise FloatingPointError("simulated overflow in the sampler")
        return real(logits, seqs)

    monkeypatch.setattr(engine, "sampler", flaky)
    server_end, core_end = multiprocessing.Pipe()
    loop = threading.Thread(target=engine_core._serve, args=(engine, core_end), daemon=True)
    loop.start()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    server_end.send(engine_core.AddRequest("poison", [1, 2, 3], params, time.perf_counter()))
    failed = server_end.recv()
    assert isinstance(failed, engine_core.StepFailed) and failed.request_ids == ["poison"]
    assert "simulated overflow" in failed.message
    server_end.send(engine_core.AddRequest("good", [4, 5, 6], params, time.perf_counter()))
    tokens = []
    while True:
        report = server_end.recv()
        assert isinstance(report, engine_core.StepReport), report
        (delta,) = report.requests
        tokens += delta.samples[0].token_ids
        if delta.finished:
            break
    assert len(tokens) == 6
    server_end.send(engine_core.QueryState())
    state = server_end.recv()
    assert state.idle and state.integrity_error is None and state.num_free_blocks == state.num_blocks
    server_end.send(engine_core.Shutdown())
    loop.join(timeout=10)
    assert not loop.is_alive()


def test_a_step_error_in_the_offline_api_leaves_no_request_behind(make_llm_for_test, smollm2_path, monkeypatch):
    from ridge import SamplingParams
    from ridge.engine.outputs import StepError

    llm = make_llm_for_test(smollm2_path, dtype="float32", kv_cache_memory="16MiB")
    real = llm.engine.runner.execute
    calls = {"n": 0}

    def fails_on_the_third_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", fails_on_the_third_step)
    with pytest.raises(StepError, match="simulated kernel failure"):
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
    monkeypatch.undo()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_a_streamed_event_stays_on_one_line_whatever_its_text():
    """Tokens can decode to U+0085 or U+2028, which JSON leaves raw and str.splitlines() (httpx's
    aiter_lines) splits on: found by `ridge bench soak` as a stream cut mid-event."""
    from ridge.serve.routes import sse

    text = "a\x85b\u2028c\u2029d\x0be\x0cf\x1cg\x1dh\x1ei\nj\rk é😀"
    event = sse({"choices": [{"text": text}]})
    line = event.removesuffix("\n\n")
    assert line.splitlines() == [line]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text
