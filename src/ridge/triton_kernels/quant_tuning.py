"""Which configuration of the quantized matmul (quant_matmul.py) serves a shape at a few rows, measured on the
GPU at the shape's first call and remembered for the process.

A decode step's matmuls are bandwidth-bound GEMVs whose best tile, split of K and kernel (registers or tensor
cores) depend on the format, the matrix and the GPU in ways a fixed heuristic got wrong by 2-3x (docs/notes/
gpu.md). Triton's autotuner would also choose by timing, but it times kernels launched one by one from Python,
which at these sizes measures the launches; here each candidate is timed replayed from a CUDA graph, and
reading a few copies of the codes larger than L2 together, since a decode step streams every layer from HBM
and a matrix that fits in L2 would otherwise be timed from it.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from ridge.triton_kernels.quant_matmul import DEFAULT, FP8, GEMV_MAX_ROWS, LARGE, Config, PackedWeight, quant_matmul

log = logging.getLogger("ridge")
T = TypeVar("T")

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
MEASURE_MS = 10  # per candidate, replayed from a graph


class Tuner:
    """Configurations chosen per (device, x dtype, rows bucket, format, matrix shape)."""

    def __init__(self) -> None:
        self.chosen: dict[tuple, Config] = {}
        self.failed: set[Config] = set()

    def config(self, x: torch.Tensor, weight: PackedWeight, multiprocessors: int) -> Config:
        rows = x.shape[0]
        if rows > GEMV_MAX_ROWS:
            return LARGE
        if not x.is_cuda:  # Triton's interpreter: correctness only
            return DEFAULT
        key = (x.device.index, x.dtype, 1 << (rows - 1).bit_length(), weight.kind, weight.group_size,
               weight.codes.dtype, tuple(weight.codes.shape))
        if key in self.chosen:
            return self.chosen[key]
        if torch.cuda.is_current_stream_capturing():  # nothing can be timed inside a capture
            return DEFAULT
        self.chosen[key] = choice = self.measure(x, weight, multiprocessors)
        log.info("ridge: quantized matmul %s x %d rows (%s): %s", tuple(weight.codes.shape), rows, x.dtype, choice)
        return choice

    def candidates(self, x: torch.Tensor, weight: PackedWeight) -> list[Config]:
        configs = ONE_ROW if x.shape[0] == 1 else FEW_ROWS
        if weight.kind == FP8 and torch.cuda.get_device_capability(x.device) >= (8, 9):
            configs = tuple(Config(**{**c.__dict__, "native_fp8": True}) for c in configs)
        return [c for c in configs if c not in self.failed and (not weight.group_size or c.tile >= weight.group_size)]

    def measure(self, x: torch.Tensor, weight: PackedWeight, multiprocessors: int) -> Config:
        timings = self.timings(x, weight, multiprocessors, self.candidates(x, weight))
        return min(timings, key=timings.__getitem__) if timings else DEFAULT

    def timings(self, x: torch.Tensor, weight: PackedWeight, multiprocessors: int,
                configs: list[Config]) -> dict[Config, float]:
        """Milliseconds a call takes in each configuration, reading the weight from HBM; a configuration that
        fails (one this GPU or Triton cannot compile) is left out, with a warning, and not tried again."""
        from triton.testing import do_bench_cudagraph

        copies = weight_copies(weight, x.device, lambda w: w.codes.nbytes)
        timings: dict[Config, float] = {}
        for config in configs:
            try:
                timings[config] = do_bench_cudagraph(cycling(copies, lambda w, c=config: quant_matmul(
                    x, w, c, multiprocessors)), rep=MEASURE_MS)
            except Exception as error:
                log.warning("ridge: quantized matmul configuration %s failed on this GPU, not used: %s", config,
                            str(error).splitlines()[0] if str(error) else type(error).__name__)
                self.failed.add(config)
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
