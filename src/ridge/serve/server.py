"""Running the server: an engine core process, the FastAPI app, uvicorn, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits up to `grace_s` for the requests
in flight; those still running then are cancelled, which aborts them in the engine, and the process
exits 0. An engine core that dies is restarted (Supervision); one that cannot be kept alive makes the
server exit 1, for whatever supervises the server to act.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from ridge.config import EngineConfig
from ridge.engine.async_engine import AsyncEngine
from ridge.engine.supervision import Supervision
from ridge.serve.app import ServerConfig, build_app
from ridge.serve.kv_transfer import check_role
from ridge.serve.metrics import EngineMetrics


@dataclass
class Server:
    engine: AsyncEngine
    uvicorn: uvicorn.Server
    host: str
    port: int
    exit_code: int = 0  # 1 once the engine is dead for good

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that also tells the engine to refuse new requests once shutdown begins, and aborts
    the requests still running a second before uvicorn's grace period ends: their clients then get an
    error (an error event on a stream) rather than a connection cut mid-response."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s
        self._abort_timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        self._engine.accepting = False
        if self._abort_timer is None:
            self._abort_timer = threading.Timer(max(0.0, self._grace_s - 1.0), self._abort_the_rest)
            self._abort_timer.daemon = True
            self._abort_timer.start()
        super().handle_exit(sig, frame)

    def _abort_the_rest(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # the engine may be gone already
            self._engine.abort_all()


def make_server(engine_config: EngineConfig, server_config: ServerConfig, host: str = "127.0.0.1",
                port: int = 8000, max_waiting: int | None = None, grace_s: float = 30.0, log_level: str = "info",
                progress: bool = True, max_queued_tokens: int | None = None,
                supervision: Supervision | None = None) -> Server:
    """Start the engine core (loading the model) and build the server around it; run() serves."""
    check_role(server_config.role, engine_config)
    server_config.check_engine(engine_config)
    metrics = EngineMetrics(server_config.model_name)
    server: Server | None = None

    def give_up(_: str) -> None:  # from the supervisor thread: uvicorn polls should_exit
        if server is not None:
            server.exit_code = 1
            server.uvicorn.should_exit = True

    async_engine = AsyncEngine(engine_config, max_waiting=max_waiting, on_step=metrics.observe_step,
                               supervision=supervision or Supervision(), progress=progress,
                               max_queued_tokens=max_queued_tokens,
                               on_give_up=give_up, grace_s=grace_s)
    async_engine.start()
    try:
        app = build_app(async_engine, metrics, server_config)
    except BaseException:  # a setting refused against the loaded model (its parsers): the core stops with it
        async_engine.stop()
        raise
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(grace_s), access_log=log_level == "debug")
    server = Server(async_engine, _Uvicorn(config, async_engine, grace_s), host, port)
    return server


def run(server: Server) -> int:
    """Serve until SIGTERM / Ctrl-C; returns once every request is finished or aborted: the exit code."""
    # uvicorn re-raises the signal that stopped it once it is done, under the handlers it found installed:
    # with these no-ops there, a drained server returns normally and the process exits 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.uvicorn.run()
    finally:
        server.engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.exit_code


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_in_thread(server: Server, timeout_s: float = 30.0) -> threading.Thread:
    """Serve from a background thread (tests, benchmarks); stop with server.uvicorn.should_exit = True."""
    thread = threading.Thread(target=run, args=(server,), name="ridge-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.uvicorn.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server did not start on {server.url}")
        time.sleep(0.02)
    return thread
