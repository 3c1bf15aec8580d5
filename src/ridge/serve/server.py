"""Running the server: an engine core process, the FastAPI app, uvicorn, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits up to `grace_s` for the requests
in flight; those still running then are cancelled, which aborts them in the engine, and the process
exits 0.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from ridge.config import EngineConfig
from ridge.engine.async_engine import AsyncEngine
from ridge.serve.app import ServerConfig, build_app
from ridge.serve.metrics import EngineMetrics


@dataclass
class Server:
    engine: AsyncEngine
    uvicorn: uvicorn.Server
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that also tells the engine to refuse new requests once shutdown begins."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        self._engine.accepting = False
        super().handle_exit(sig, frame)


def make_server(engine_config: EngineConfig, server_config: ServerConfig, host: str = "127.0.0.1",
                port: int = 8000, max_waiting: int | None = None, grace_s: float = 30.0, log_level: str = "info",
                progress: bool = True) -> Server:
    """Start the engine core (loading the model) and build the server around it; run() serves."""
    metrics = EngineMetrics(server_config.model_name)
    async_engine = AsyncEngine(engine_config, max_waiting=max_waiting, on_step=metrics.observe_step,
                               progress=progress)
    async_engine.start()
    app = build_app(async_engine, metrics, server_config)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(grace_s), access_log=log_level == "debug")
    return Server(async_engine, _Uvicorn(config, async_engine), host, port)


def run(server: Server) -> None:
    """Serve until SIGTERM / Ctrl-C; returns once every request is finished or aborted."""
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
