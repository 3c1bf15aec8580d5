"""ridge's hand-written CPU kernels, compiled on first use.

- paged_attention.cpp: decode attention straight from the paged KV cache. torch has no paged attention
  for the CPU; built from torch ops it gathers every sequence's blocks into a dense copy per layer and
  step, moving three times the KV bytes the math needs.
- quantized_attention.cpp: the same over an int8 / fp8 / int4 cache (--kv-cache-dtype), the codes widened in
  registers: a dequantized copy would move the bytes the format saves.
- fused_ops.cpp: residual add + RMSNorm, silu(gate) * up, rotary, each one pass instead of 3-8 torch ops:
  at batch 1 a small model's step is bounded by per-op overhead as much as by its weight reads.
- dense_linear.cpp: float32 linear layers at decode's few rows: torch's runs MKL's sgemv on one thread.
- quant_linear.cpp: linear layers over int8 codes with grouped scales (GGUF's 5-8-bit block formats):
  torch's CPU kernels take one scale per output channel or 4-bit codes, nothing else.
- int8_dot_linear.cpp: the same with the input quantized to int8 (opt-in, not exact): integer dot products,
  llama.cpp's arithmetic, for CPUs where widening codes to float bounds the float kernel.
- vnni_linear.cpp: the same arithmetic as a matrix kernel on AVX512-VNNI's integer dot products, for any
  number of rows: at a batch of 32 bf16 matmul is bound by arithmetic, and only integer products let 4-bit
  weights stay ahead of it.
- bf16_dot_linear.cpp: 4- and 8-bit layers for bfloat16 inputs, exact, on AVX512-BF16 dot products over
  vnni_linear's layout: the float kernels above spend ~3 instructions per 16 weights and were bound by them, not
  by memory.
- latent_attention.cpp: latent attention's (MLA's) decode over its paged rows, and the per-head products that
  fold kv_b into the query and out of the result: from torch ops, a padded float32 copy of every row's context
  per layer and step, and bmm over kv_b's slices copied each call, took three times its weights' read.
- decode_stack.cpp: a decode step's decoder layers in one call over the kernels above: at batch 1 the Python
  between ~300 kernel calls a step cost a third of the step (kernels/decode_stack.py).
- state_space.cpp: a Mamba-2 mixer's decode token (convolution step and recurrence) in one pass over its state,
  in place: from torch ops, five passes over the state and a slow bmm, most of the layer's time but its matmuls.
- gguf_blocks.cpp: a GGUF file's block formats dequantized in one pass (loading a GGUF model to float32 or
  bfloat16): unpacked with torch ops, a fresh tensor per step, it was most of a model's load.

torch builds them with the system C++ compiler, into a folder of $RIDGE_HOME/kernels named by the sources'
location and contents, the flags, torch's version and the CPU's instruction sets: the first start pays
about a minute, later ones nothing, and two checkouts never rebuild each other's (in torch's one shared
folder per extension name, each rebuilt it whenever the other had run). Without a compiler, ridge keeps
the pure-torch paths, which give the same results more slowly.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path
from types import ModuleType

from ridge.hub import ridge_home

log = logging.getLogger("ridge")
SOURCES = [Path(__file__).with_name(n)
           for n in ("bindings.cpp", "paged_attention.cpp", "quantized_attention.cpp", "fused_ops.cpp",
                     "quant_linear.cpp", "dense_linear.cpp", "int8_dot_linear.cpp", "vnni_linear.cpp",
                     "bf16_dot_linear.cpp", "latent_attention.cpp", "decode_stack.cpp", "gguf_blocks.cpp",
                     "state_space.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("vec.h", "decode_stack.h", "decode_tasks.h", "ops.h",
                                                "vnni_layout.h")]


@cache
def load() -> ModuleType | None:
    try:
        import torch
        from torch.utils.cpp_extension import load as build

        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
        # -march=native: a build is for this CPU's instruction sets (a home folder may move between machines)
        key = hashlib.sha256(repr((str(Path(__file__).parent), flags, torch.__version__, cpu_flags())).encode())
        for source in SOURCES + HEADERS:  # torch looks at the sources' contents, not at headers'
            key.update(source.read_bytes())
        folder = ridge_home() / "kernels" / key.hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        return build(name="ridge_cpu_ops", sources=[str(s) for s in SOURCES], extra_cflags=flags,
                     extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except Exception as exc:  # no compiler, no headers, a build error: fall back, loudly
        log.warning("ridge: C++ CPU kernels unavailable (%s); using the torch paths", exc)
        return None


def cpu_flags() -> str:
    """The CPU's instruction-set flags as Linux lists them ('' elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""
