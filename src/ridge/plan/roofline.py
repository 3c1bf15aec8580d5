"""The machine's own ceilings, measured on the spot: read bandwidth and matmul FLOP/s, of the CPU or a GPU.

Benchmarks report a run as a fraction of these, so a figure says how close it came to the wall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ridge.linear.dense import onednn_packs


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


def remeasured(roof: Roofline, device: str = "cpu") -> Roofline:
    """roof, its read bandwidth the better of its own and a probe taken now. A shared host's read bandwidth moves
    from minute to minute (figures: docs/benchmarks.md's MoE section): a benchmark probes again after its runs,
    so that no fraction of the roofline stands on one probe from a slow minute."""
    now = measure(dtypes=(), device=device).read_gb_s
    return replace(roof, read_gb_s=max(roof.read_gb_s, now))


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 3, probe: int = 512) -> float:
    """Square matmuls of side n; where a probe of side `probe` shows that one would take over 4 s (a
    dtype the CPU only emulates), the side stays at the probe's, which is large enough to be compute-bound and
    keeps the measurement from taking minutes. bf16 where oneDNN cannot pack it (CPUs without AVX512): torch's
    bf16 matmul there is emulated, and ridge multiplies such weights widened to float32 (linear/dense.py), so
    float32's ceiling is theirs."""
    if dtype == torch.bfloat16 and not onednn_packs(torch.bfloat16, "cpu"):
        dtype = torch.float32
    a = torch.randn(probe, probe, dtype=dtype)
    probe_seconds = _best(lambda: a @ a, 1)
    if probe_seconds * (n / probe) ** 3 > 4.0:
        return 2 * probe**3 / _best(lambda: a @ a, repeats) / 1e9
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats) / 1e9


def measure(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32), device: str = "cpu") -> Roofline:
    """The ceilings of `device`: the CPU's, or a CUDA GPU's (measure_cuda)."""
    if torch.device(device).type == "cuda":
        return measure_cuda(dtypes, device)
    return Roofline(
        read_gb_s=measure_read_bandwidth(),
        matmul_gflop_s={str(d).removeprefix("torch."): measure_matmul(d) for d in dtypes},
    )


def _cuda_seconds(fn, repeats: int) -> float:
    """The median time of fn() on the GPU, by CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_cuda(dtypes: tuple[torch.dtype, ...], device: str = "cuda") -> Roofline:
    """HBM bandwidth from a device-to-device copy of 4 GiB (bytes read and written, what the memory moves,
    about 90% of the datasheet's figure on an H100), and matmul throughput from 8192-cubed products."""
    flops = {str(dtype).removeprefix("torch."): _cuda_matmul_gflop_s(dtype, device) for dtype in dtypes}
    roof = Roofline(read_gb_s=_cuda_copy_gb_s(device), matmul_gflop_s=flops)
    torch.cuda.empty_cache()
    return roof


def _cuda_copy_gb_s(device: str) -> float:
    source = torch.empty(2**30, dtype=torch.float32, device=device)  # 4 GiB: far past the L2
    target = torch.empty_like(source)
    return 2 * source.nbytes / _cuda_seconds(lambda: target.copy_(source), 10) / 1e9


def _cuda_matmul_gflop_s(dtype: torch.dtype, device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _cuda_seconds(lambda: a @ b, 10) / 1e9
