"""Quantized weights on CUDA, held as codes and multiplied without a dense copy.

int4 in a bfloat16 model runs on torch's CUDA int4 kernel (tinygemm, linear/int4pack.py), whose own packed
layout it holds; every other format and dtype (int8, fp8, GPTQ / AWQ zero points in float16 models, float32
models) on the Triton kernels of triton_kernels/quant_matmul.py. For many rows (a prefill) either may instead
widen the matrix once and call cuBLAS; which way serves a shape and a number of rows is measured at first use
(triton_kernels/quant_tuning.py).

Per-group scales and minimums are held in float16 for the Triton kernels, as GPTQ / AWQ checkpoints and
llama.cpp's blocks hold them: at int4 per 32 weights, float32 ones would add half a byte per weight to the 4
bits a decode step reads. ridge's own int4 makes them float16 numbers (quant/rtn.py), so the GPU computes
what the CPU does; a GPTQ / AWQ minimum (-zero * scale) is rounded. Per-channel scales stay float32.
"""

from __future__ import annotations

import logging
from functools import cached_property

import torch

from ridge.linear import int4pack
from ridge.linear.base import KernelLinear
from ridge.quant.rtn import QuantizedWeight

log = logging.getLogger("ridge")


class TritonQuantLinear(KernelLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        from ridge.triton_kernels import quant_matmul, quant_tuning  # Triton comes with CUDA torch; only here

        super().__init__(*weight.shape, bias, dtype)
        self.ops, self.tuning = quant_matmul, quant_tuning
        if weight.group_size is None and weight.minimums is not None:
            raise ValueError("quantization: per-channel codes with a minimum have no CUDA kernel")
        self.group_size = weight.group_size or 0
        codes = weight.qweight
        self.register_buffer("int4pack", None, persistent=False)
        if codes.dtype == torch.float8_e4m3fn:
            self.kind, self.kernel = quant_matmul.FP8, "triton_fp8"
            codes = codes.view(torch.uint8)
        elif int4pack.fits(weight, dtype):
            self.kind, self.kernel = quant_matmul.NIBBLES, "int4pack"
            self.int4pack, scales_and_zeros = int4pack.pack(weight, torch.device(device))
            self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
            codes = None
        elif weight.levels is not None:  # MXFP4's: select.py widens any other table
            if not quant_matmul.fits(quant_matmul.E2M1, self.in_features, self.group_size):
                raise ValueError(f"quantization: a {self.in_features}-column MXFP4 layer's halves do not start "
                                 f"blocks of {self.group_size}: no CUDA layout")
            self.kind, self.kernel = quant_matmul.E2M1, "triton_mxfp4"
            codes = quant_matmul.pack_nibbles(codes.to(torch.uint8))
        elif weight.bits == 4 and quant_matmul.fits(quant_matmul.NIBBLES, self.in_features, self.group_size):
            self.kind, self.kernel = quant_matmul.NIBBLES, "triton_int4"
            codes = quant_matmul.pack_nibbles(codes.to(torch.uint8))
        else:
            if weight.bits == 4:
                log.warning("ridge: a %d-column int4 layer in groups of %d holds a byte per code on CUDA (its halves "
                            "do not start groups): twice the bytes of packed nibbles", self.in_features,
                            self.group_size)
            self.kind, self.kernel = quant_matmul.BYTES, f"triton_int{weight.bits}"
        held = codes is not None  # else tinygemm's layout holds them
        self.register_buffer("codes", codes.contiguous() if held else None, persistent=False)
        # per group: float16, the bytes a decode reads; per channel: float32, a row's worth (fp8's scales are not
        # float16 numbers)
        scales = weight.scales.to(torch.float16 if self.group_size else torch.float32).contiguous()
        self.register_buffer("scales", scales if held else None, persistent=False)
        minimums = None if weight.minimums is None or not held else weight.minimums.half().contiguous()
        self.register_buffer("minimums", minimums, persistent=False)

    @cached_property
    def multiprocessors(self) -> int:
        device = self.codes.device if self.codes is not None else self.int4pack.device
        return torch.cuda.get_device_properties(device).multi_processor_count

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.int4pack is not None:
            packed = (self.int4pack, self.scales_and_zeros)
            if self._widens(x, packed):
                return x @ int4pack.dense(*packed, self.group_size, x.dtype).T
            return int4pack.multiply(x, *packed, self.group_size)
        weight = self.ops.PackedWeight(self.codes, self.kind, self.scales, self.minimums, self.group_size,
                                       self.out_features)
        return self.ops.quant_matmul(x, weight, self.tuning.TUNER.config(x, weight, self.multiprocessors),
                                     self.multiprocessors)

    def _widens(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether, at x's rows (a prefill), tinygemm's matrix is better widened once and multiplied by cuBLAS than
        multiplied by tinygemm: measured once per bucket of rows and shape."""
        if x.shape[0] <= self.ops.GEMV_MAX_ROWS:
            return False
        key = (x.device.index, x.dtype, self.tuning.rows_bucket(x.shape[0]), "int4pack", self.group_size,
               tuple(packed[0].shape))
        group = self.group_size
        ways = {"tinygemm": lambda p: int4pack.multiply(x, *p, group),
                "widened for cuBLAS": lambda p: x @ int4pack.dense(*p, group, x.dtype).T}
        choice = self.tuning.TUNER.choose(key, ways, packed, lambda p: p[0].nbytes + p[1].nbytes, x.device,
                                          "tinygemm")  # measured at a key's first call, remembered after
        return choice == "widened for cuBLAS"
