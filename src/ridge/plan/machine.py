"""`this-machine` as a HardwareSpec: its ceilings measured on the spot (plan/roofline.py), its memory
read from the OS. Measured figures are what this machine reaches with torch's own kernels, not a
datasheet's peaks: the fair yardstick for what ridge gets here."""

from __future__ import annotations

import os

import torch

from ridge.plan.roofline import Roofline, measure

DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}  # torch dtype name -> plan's


def physical_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def hardware_from_roofline(roofline: Roofline, name: str = "this-machine"):
    from ridge.plan.specs import HardwareSpec

    # 6 decimals: a dtype the CPU only emulates (bf16 without AVX512-BF16) can measure well under 1 GFLOP/s,
    # which 3 decimals of TFLOP/s would round to zero
    tflops = {DTYPE_NAMES.get(k, k): round(v / 1e3, 6) for k, v in roofline.matmul_gflop_s.items() if v > 0}
    source = f"measured here: {roofline.describe()} ({torch.get_num_threads()} threads)"
    return HardwareSpec(name=name, memory_gb=round(physical_memory_gb(), 1),
                        bandwidth_gb_s=round(roofline.read_gb_s, 1), tflops=tflops, source=source)


def measure_this_machine():
    return hardware_from_roofline(measure())
