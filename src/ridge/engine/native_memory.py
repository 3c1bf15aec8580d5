"""Keeping the engine core's native memory flat over a long serve.

Two kinds of native memory grow with the variety of a server's steps, not with its requests, and neither is
Python's:
- oneDNN compiles a matmul for every (shape, row count) it meets; torch's glue (ideep) keeps up to 1,024 of
  them in an LRU cache and oneDNN up to 1,024 more of its own, so a server whose prompts chunk into ever new
  row counts fills both;
- glibc's malloc raises its mmap threshold to the largest block freed, after which large activations come
  from the heap, and the free pages between them stay resident.
A model's load leaves its freed temporaries resident too, until the first trim (trim_heap).
The core caps both caches at COMPILED_MATMULS (set before oneDNN's first use, unless the user set them) and hands
free heap pages back to the system every TRIM_EVERY_S of stepping and whenever it goes idle. The soaks that found
and fixed this, and what a compile and a trim cost: docs/notes/server-hardening.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from functools import cache

# enough for the recent row counts of every shape a step meets, in a few tens of MiB
COMPILED_MATMULS = 128
TRIM_EVERY_S = 30.0


def bound_onednn_caches() -> None:
    """Cap ideep's and oneDNN's caches of compiled matmuls; both read their variable when first used."""
    for variable in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(COMPILED_MATMULS))


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim; None where the C library has none (musl, macOS)."""
    libc_name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None


def trim_heap() -> None:
    """Hand the heap's free pages back to the system now: a model's load frees temporaries as large as the
    weights it keeps (dequantized tensors, the parts of fused ones), resident until trimmed (figures:
    docs/notes/server-hardening.md)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


class HeapTrimmer:
    """malloc_trim(0) at most every TRIM_EVERY_S while busy, and once each time the core goes idle. A no-op
    where the C library has no malloc_trim."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._last = time.monotonic()
        self._busy = False

    def after_step(self, idle: bool) -> None:
        if self._trim is None:
            return
        if idle:
            if self._busy:
                self._trim(0)
                self._busy = False
        else:
            self._busy = True
            if time.monotonic() - self._last > TRIM_EVERY_S:
                self._trim(0)
                self._last = time.monotonic()
