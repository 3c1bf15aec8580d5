"""engine/processes.py: the processes ridge forks from its fork server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ridge.engine import processes


def _report(path: str) -> None:
    Path(path).write_text(json.dumps({"variable": os.environ.get("RIDGE_PROCESS_CHECK"), "cwd": os.getcwd()}))


def test_a_child_runs_in_its_callers_environment_and_directory_of_now(tmp_path, monkeypatch):
    """The fork server, started before the caller changed its environment and directory, forks a child that sees
    the caller's of the moment it started it, as a spawned interpreter would."""
    first = processes.start(time.sleep, (0,), "ridge-test")  # the fork server runs from here on
    first.join(60)
    assert first.exitcode == 0
    monkeypatch.setenv("RIDGE_PROCESS_CHECK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    child = processes.start(_report, (str(tmp_path / "seen.json"),), "ridge-test")
    child.join(60)
    assert child.exitcode == 0
    assert json.loads((tmp_path / "seen.json").read_text()) == {"variable": "set after the server started",
                                                                "cwd": str(tmp_path)}


def test_a_child_left_running_is_killed_when_its_caller_exits():
    """Not a daemon, so multiprocessing's exit would wait on it: processes.py kills it first, and the caller exits."""
    code = ("import time; from ridge.engine import processes; "
            "print(processes.start(time.sleep, (600,), 'ridge-test').pid, flush=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # the fork server reaps it as it exits
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
