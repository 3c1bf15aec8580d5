"""The processes ridge starts beside itself on one machine (an engine core, tensor-parallel ranks 1..N-1).

They fork from one fork server that has imported ridge's engine once, so a start costs a fork rather than a fresh
interpreter's imports of torch and ridge (seconds of CPU, paid again by every rank and every restarted core). The
fork server holds none of its caller's threads or locks, so forking it is safe where forking a server would not be.
As under spawn, each child imports the caller's main module again: a script keeps its top level under
`if __name__ == "__main__":`.

A fork server's child inherits the server's environment and working directory from when the server started, not
its caller's now: `start` hands the caller's to the child, which takes them before it runs its target, so the child
sees what a spawned interpreter would. What a library reads once at its import (libgomp's OMP_* variables) comes
from the server's start; ridge sets its own thread counts explicitly.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.util
import os
import weakref
from collections.abc import Callable
from typing import Any

# the modules of every target started here, imported by the fork server before its first fork
PRELOADED = ["ridge.engine.engine_core", "ridge.engine.tensor_parallel"]


@functools.cache
def context() -> multiprocessing.context.BaseContext:
    """The fork server's context (spawn's where the platform has no fork server)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOADED)
    return forkserver


_started: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()


def start(target: Callable[..., Any], args: tuple[Any, ...], name: str) -> multiprocessing.process.BaseProcess:
    """Run target(*args) in a new process, in this process's environment and working directory.

    Not a daemon, since a daemon may not start processes of its own (an engine core starts its tensor-parallel
    ranks): its caller ends it, and one still running when this interpreter exits is killed then, as multiprocessing
    ends a daemon (its exit would otherwise wait on it). An owner that stops its processes at exit does so in a
    multiprocessing.util.Finalize above EXIT_PRIORITY, which runs first."""
    process = context().Process(target=_in_callers_environment, name=name,
                                args=(dict(os.environ), os.getcwd(), target, args))
    process.start()
    _started.add(process)
    return process


def _kill_the_unended() -> None:
    for process in list(_started):
        if process.is_alive():
            process.kill()
            process.join()


# multiprocessing's exit runs its finalizers of priority >= 0, highest first, before it joins the processes left
EXIT_PRIORITY = 0
multiprocessing.util.Finalize(None, _kill_the_unended, exitpriority=EXIT_PRIORITY)


def _in_callers_environment(environment: dict[str, str], cwd: str, target: Callable[..., Any],
                            args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    target(*args)
