"""Loads the C++ paged decode-attention kernel (paged_attention.cpp), compiling it on first use.

torch builds it with the system C++ compiler into its extension cache (~/.cache/torch_extensions), so
the first engine start of a machine pays about a minute and later ones nothing. Without a compiler
the paged backend keeps its pure-torch decode path, which gives the same results, more slowly.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger("ridge")
SOURCE = Path(__file__).with_name("paged_attention.cpp")


@cache
def load() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as build

        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
        return build(name="ridge_paged_attention", sources=[str(SOURCE)], extra_cflags=flags,
                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, a build error: fall back, loudly
        log.warning("ridge: C++ paged attention unavailable (%s); using the torch decode path", exc)
        return None
