"""The machine's own ceilings, measured on the spot: read bandwidth and matmul FLOP/s.

Benchmarks report a run as a fraction of these, so a figure says how close it came to the wall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Roofline:
    read_gb_s: float  # streaming read of a tensor far larger than the caches we can control
    matmul_gflop_s: dict[str, float]  # dtype name -> dense matmul throughput

    def describe(self) -> str:
        flops = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in self.matmul_gflop_s.items())
        return f"read {self.read_gb_s:.1f} GB/s; matmul {flops}"


def timings(fn, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of fn(), after one warm-up call (kernels built, caches filled)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best(fn, repeats: int) -> float:
    return min(timings(fn, repeats))


def measure_read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats) / 1e9


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 3, probe: int = 512) -> float:
    """Square matmuls of side n; where a probe of side `probe` shows that one would take over 4 s (a
    dtype the CPU only emulates: bf16 on an AVX2 CPU ran under 1 GFLOP/s), the side stays at the probe's,
    which is large enough to be compute-bound and keeps the measurement from taking minutes."""
    a = torch.randn(probe, probe, dtype=dtype)
    probe_seconds = _best(lambda: a @ a, 1)
    if probe_seconds * (n / probe) ** 3 > 4.0:
        return 2 * probe**3 / _best(lambda: a @ a, repeats) / 1e9
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats) / 1e9


def measure(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> Roofline:
    return Roofline(
        read_gb_s=measure_read_bandwidth(),
        matmul_gflop_s={str(d).removeprefix("torch."): measure_matmul(d) for d in dtypes},
    )
