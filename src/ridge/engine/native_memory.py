"""Keeping the engine core's native memory flat over a long serve.

Two kinds of native memory grow with the variety of a server's steps, not with its requests, and neither is
Python's:
- oneDNN compiles a matmul for every (shape, row count) it meets; torch's glue (ideep) keeps up to 1,024 of
  them in an LRU cache and oneDNN up to 1,024 more of its own, so a server whose prompts chunk into ever new
  row counts fills both;
- glibc's malloc raises its mmap threshold to the largest block freed, after which large activations come
  from the heap, and the free pages between them stay resident.
The core caps both caches at COMPILED_MATMULS (set before oneDNN's first use, unless the user set them) and hands
free heap pages back to the system every TRIM_EVERY_S of stepping and whenever it goes idle. The soaks that found
and fixed this, and what a compile and a trim cost: docs/notes/server-hardening.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

# enough for the recent row counts of every shape a step meets, in a few tens of MiB
COMPILED_MATMULS = 128
TRIM_EVERY_S = 30.0


def bound_onednn_caches() -> None:
    """Cap ideep's and oneDNN's caches of compiled matmuls; both read their variable when first used."""
    for variable in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(COMPILED_MATMULS))


class HeapTrimmer:
    """malloc_trim(0) at most every TRIM_EVERY_S while busy, and once each time the core goes idle. A no-op
    where the C library has no malloc_trim (musl, macOS)."""

    def __init__(self) -> None:
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        self._trim = getattr(libc, "malloc_trim", None)
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
