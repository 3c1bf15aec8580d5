"""The fastest way to multiply by a quantized matrix at a number of rows (in buckets: powers of two): a
configuration of the Triton kernels (quant_matmul.py), or any ways a caller names (linear/triton.py: tinygemm
against widening its matrix for cuBLAS); measured on the GPU at the first call and remembered for the process.

A decode step's matmuls are bandwidth-bound GEMVs whose best tile, split of K and kernel (registers or tensor cores)
depend on the format, the matrix and the GPU in ways no fixed heuristic caught (docs/notes/gpu.md measures the
candidates); with more rows the tiled kernels compete with widening the matrix once for cuBLAS. Triton's autotuner
would also choose by timing, but it times kernels launched one by one from Python, which at these sizes measures the
launches; here each candidate is timed replayed from a CUDA graph, reading a few copies of the codes larger than L2
in turn, since a decode step streams every layer from HBM and a matrix that fits in L2 would otherwise be timed from
it.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from ridge.triton_kernels.quant_matmul import (
    DEFAULT,
    DENSE,
    FP8,
    GEMV_MAX_ROWS,
    LARGE,
    Config,
    PackedWeight,
    quant_matmul,
)

log = logging.getLogger("ridge")
T = TypeVar("T")
H = TypeVar("H", bound=Hashable)

ONE_ROW = (
    DEFAULT,
    Config(block_n=8, tile=512, programs_per_sm=0),
    Config(block_n=16, tile=256, programs_per_sm=0),
    Config(block_n=16, tile=512, programs_per_sm=4),
    Config(block_n=32, tile=256, programs_per_sm=4),
    Config(block_n=32, tile=512, warps=8, programs_per_sm=4),
    Config(mma=True, block_n=64, tile=128, programs_per_sm=4),
)
FEW_ROWS = (
    DEFAULT,
    Config(block_n=16, tile=256, programs_per_sm=4),
    Config(mma=True, block_n=64, tile=128, programs_per_sm=4),
    Config(mma=True, block_n=32, tile=256, programs_per_sm=4),
)
MANY_ROWS = (
    LARGE,
    Config(mma=True, block_n=128, tile=64, warps=8, programs_per_sm=0),
    Config(mma=True, block_n=64, tile=64, warps=4, programs_per_sm=4),
    DENSE,
)
MEASURE_MS = 10  # per candidate, replayed from a graph
MAX_BUCKET = 1024  # more rows than this are measured as this many


def rows_bucket(rows: int) -> int:
    """The power of two at or above `rows`, up to MAX_BUCKET: the row counts that share a measurement."""
    return min(1 << (rows - 1).bit_length(), MAX_BUCKET)


class Tuner:
    """The fastest way to multiply, per (device, x dtype, rows bucket, format, matrix shape)."""

    def __init__(self) -> None:
        self.chosen: dict[tuple, Hashable] = {}
        self.failed: set[Hashable] = set()

    def config(self, x: torch.Tensor, weight: PackedWeight, multiprocessors: int) -> Config:
        """The quantized matmul's configuration for x's rows."""
        rows = x.shape[0]
        fallback = DEFAULT if rows <= GEMV_MAX_ROWS else LARGE
        if not x.is_cuda:  # Triton's interpreter: correctness only
            return fallback
        key = (x.device.index, x.dtype, rows_bucket(rows), weight.kind, weight.group_size, weight.codes.dtype,
               tuple(weight.codes.shape))
        if key in self.chosen:  # every call but a shape's first: nothing else to do
            return self.chosen[key]
        options = {config: (lambda w, c=config: quant_matmul(x, w, c, multiprocessors))
                   for config in self.candidates(x, weight)}
        return self.choose(key, options, weight, lambda w: w.codes.nbytes, x.device, fallback)

    def choose(self, key: tuple, options: dict[H, Callable[[T], object]], weight: T, nbytes: Callable[[T], int],
               device: torch.device, fallback: H) -> H:
        """The fastest of `options` (each a call on a copy of `weight`), measured once per key (not inside a
        CUDA graph's capture, which cannot time anything: there the fallback, unremembered)."""
        if key in self.chosen:
            return self.chosen[key]
        if torch.cuda.is_current_stream_capturing():
            return fallback
        timings = self.timings(options, weight, nbytes, device)
        self.chosen[key] = choice = min(timings, key=timings.__getitem__) if timings else fallback
        log.info("ridge: quantized matmul %s: %s", key, choice)
        return choice

    def candidates(self, x: torch.Tensor, weight: PackedWeight) -> list[Config]:
        rows = x.shape[0]
        configs = ONE_ROW if rows == 1 else FEW_ROWS if rows <= GEMV_MAX_ROWS else MANY_ROWS
        if weight.kind == FP8 and torch.cuda.get_device_capability(x.device) >= (8, 9):
            configs = tuple(Config(**{**c.__dict__, "native_fp8": True}) for c in configs)
        return [c for c in configs if c not in self.failed and (not weight.group_size or c.tile >= weight.group_size)]

    def timings(self, options: dict[H, Callable[[T], object]], weight: T, nbytes: Callable[[T], int],
                device: torch.device) -> dict[H, float]:
        """Milliseconds each option's call takes, reading the weight from HBM; an option that fails (a
        configuration this GPU or Triton cannot compile) is left out, with a warning, and not tried again."""
        from triton.testing import do_bench_cudagraph

        copies = weight_copies(weight, device, nbytes)
        timings: dict[H, float] = {}
        for option, call in options.items():
            if option in self.failed:
                continue
            try:
                timings[option] = do_bench_cudagraph(cycling(copies, call), rep=MEASURE_MS)
            except Exception as error:
                log.warning("ridge: quantized matmul option %s failed on this GPU, not used: %s", option,
                            str(error).splitlines()[0] if str(error) else type(error).__name__)
                self.failed.add(option)
        return timings


def weight_copies(weight: T, device: torch.device, nbytes: Callable[[T], int]) -> list[T]:
    """`weight` and enough copies of it to fill twice the GPU's L2, so that cycling through them reads HBM."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return [weight] + [copy.deepcopy(weight) for _ in range(min(15, math.ceil(2 * l2 / nbytes(weight)) - 1))]


def cycling(copies: list[T], call: Callable[[T], object]) -> Callable[[], None]:
    """A function that calls `call` on the next copy each time (a graph records the calls in turn)."""
    turn = iter(range(1 << 62))

    def step() -> None:
        call(copies[next(turn) % len(copies)])
    return step


TUNER = Tuner()  # this process's measurements, shared by every layer of a shape (as Triton's autotuner caches)
