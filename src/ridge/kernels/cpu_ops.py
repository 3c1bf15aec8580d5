"""ridge's hand-written CPU kernels, compiled on first use.

- paged_attention.cpp: decode attention straight from the paged KV cache. torch has no paged attention
  for the CPU; built from torch ops it gathers every sequence's blocks into a dense copy per layer and
  step, moving three times the KV bytes the math needs.
- fused_ops.cpp: residual add + RMSNorm, silu(gate) * up, rotary, each one pass instead of 3-8 torch ops:
  at batch 1 a small model's step is bounded by per-op overhead as much as by its weight reads.
- quant_linear.cpp: linear layers over int8 codes with grouped scales (GGUF's 5-8-bit block formats):
  torch's CPU kernels take one scale per output channel or 4-bit codes, nothing else.

torch builds them with the system C++ compiler into its extension cache (~/.cache/torch_extensions):
the first start on a machine pays about a minute, later ones nothing. Without a compiler, ridge keeps
the pure-torch paths, which give the same results more slowly.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger("ridge")
SOURCES = [Path(__file__).with_name(n)
           for n in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "quant_linear.cpp")]
HEADERS = [Path(__file__).with_name("vec.h")]


@cache
def load() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as build

        # torch rebuilds when the sources or flags change, but does not look at headers: their hash goes
        # into the flags
        header_hash = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
                 f"-DRIDGE_HEADERS_{header_hash}"]
        return build(name="ridge_cpu_ops", sources=[str(s) for s in SOURCES], extra_cflags=flags,
                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, a build error: fall back, loudly
        log.warning("ridge: C++ CPU kernels unavailable (%s); using the torch paths", exc)
        return None
