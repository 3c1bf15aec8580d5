"""Quantized weights on torch's and ridge's CPU kernels, one class per kernel; each streams the codes and
dequantizes in registers. The buffers are not persistent: they are a kernel's layout, not a checkpoint's.

- Int8Linear: int8 codes per output channel; bfloat16 on ridge's grouped kernel with one group a row
  (faster than torch's at every row count measured), else torch's aten._weight_int8pack_mm.
- Int4Linear: 4-bit codes per group on torch's aten._weight_int4pack_mm_for_cpu (a tiled layout torch
  converts to at load); from TILED_MIN_ROWS rows in bfloat16, ridge's tiled kernel dequantizes a tile once
  and multiplies it on oneDNN's bf16 matmul (kernels/quant_linear.cpp).
- GroupedInt8Linear: int8 codes (or 4-bit ones two a byte, read as themselves or through a table of levels:
  MXFP4, its power-of-two scales held as exponent bytes) per group on ridge's grouped_int8_linear, as torch has
  no kernel for grouped scales; float32's every
  int8 and 4-bit format too, torch's two kernels being slow there. With int8 activations (AVX2), inputs of up
  to INT8_ACTIVATIONS_MAX_ROWS rows are quantized to int8 and multiplied as integers
  (kernels/int8_dot_linear.cpp states the error bound).
- Fp8Linear: e4m3 codes per output channel widened to the activation dtype per call, the scale applied to
  the output. The CPU has no fp8 matmul: this halves weight memory against bfloat16, not decode time.
- DequantizedLinear: the dequantized matrix, where no kernel runs (not the CPU): the same numbers at the
  plain path's speed and memory.
On float32, torch's int8 / int4 kernels are built for decode: past FLOAT32_KERNEL_MAX_ROWS rows the layer
multiplies by its dequantized weight instead (docs/notes/kernel-choices.md).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from ridge.linear.base import NO_TENSOR, KernelLinear
from ridge.linear.layouts import int4pack_block_width, pack_nibbles
from ridge.linear.rows import FLOAT32_KERNEL_MAX_ROWS, INT8_ACTIVATIONS_MAX_ROWS, TILED_MIN_ROWS
from ridge.quant.rtn import QuantizedWeight, dequantize


def _tiled_ops(ops: ModuleType | None, dtype: torch.dtype, in_features: int) -> ModuleType | None:
    """ridge's tiled kernels, for many bf16 rows (the grouped-int8 one needs K in 16s)."""
    return ops if ops is not None and dtype == torch.bfloat16 and in_features % 16 == 0 else None


class Int8Linear(KernelLinear):
    kernel = "int8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 ops: ModuleType | None) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.tiled_ops = _tiled_ops(ops, dtype, self.in_features)
        self.register_buffer("qweight", weight.qweight.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.to(dtype), persistent=False)
        # ridge's grouped kernel's form of the same scales: one group spanning the row, in float32
        self.register_buffer("channel_scales", weight.scales.float()[:, None].contiguous(), persistent=False)
        self.register_buffer("no_minimums", torch.empty(0), persistent=False)
        self.unpacked = weight if dtype == torch.float32 else None

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled_ops is not None:  # ridge's kernel at every row count, decode's few rows included
            return self.tiled_ops.grouped_int8_linear(x, self.qweight, self.channel_scales, self.no_minimums,
                                                      self.in_features, NO_TENSOR)
        if self.unpacked is not None and x.shape[0] > FLOAT32_KERNEL_MAX_ROWS:
            return x @ dequantize(self.unpacked).T
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    @property
    def weight_bytes(self) -> int:
        # channel_scales: the scales again in the grouped kernel's form, read instead of `scales`
        return self.qweight.nbytes + self.scales.nbytes + self.no_minimums.nbytes

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any | None:
        if self.tiled_ops is None:
            return None
        return ops.LinearPart("grouped_int8", self.qweight, self.channel_scales, self.no_minimums,
                              self.in_features, False, bias, 0)


class Int4Linear(KernelLinear):
    kernel = "int4"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 ops: ModuleType | None) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.group_size = weight.group_size
        self.tiled_ops = _tiled_ops(ops, dtype, self.in_features)
        # the kernel packs rows by 16: pad with zero rows, whose outputs multiply() drops
        pad = -self.out_features % 16
        codes = nn.functional.pad(weight.qweight.to(torch.int32), (0, 0, 0, pad)).contiguous()
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                             persistent=False)
        self.block_width = int4pack_block_width()
        # its zero point is the value of code 8: w = (q - 8) * scale + zero
        zeros = weight.minimums + 8 * weight.scales
        pairs = nn.functional.pad(torch.stack([weight.scales, zeros], dim=-1), (0, 0, 0, 0, 0, pad))
        self.register_buffer("scales_and_zeros", pairs.transpose(0, 1).contiguous().to(dtype),  # [G, N, 2]
                             persistent=False)
        self.unpacked = weight if dtype == torch.float32 else None  # float32: the codes again, for many rows

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.tiled_ops is not None and rows >= TILED_MIN_ROWS:
            out = self.tiled_ops.int4pack_linear(x, self.qweight, self.scales_and_zeros, self.group_size,
                                                 self.block_width)
        elif self.unpacked is not None and rows > FLOAT32_KERNEL_MAX_ROWS:
            return x @ dequantize(self.unpacked).T
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales_and_zeros)
        return out[:, :self.out_features] if out.shape[1] != self.out_features else out  # the padded rows

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any | None:
        if self.unpacked is not None:  # float32 changes path past FLOAT32_KERNEL_MAX_ROWS
            return None
        return ops.LinearPart("int4pack", self.qweight, self.scales_and_zeros, NO_TENSOR, self.group_size, False,
                              bias, self.out_features)


class GroupedInt8Linear(KernelLinear):
    kernel = "grouped_int8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, ops: ModuleType,
                 int8_activations: bool = False) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.ops = ops
        self.group_size = weight.group_size or self.in_features  # int8: one group per output channel
        if weight.levels is not None and (self.group_size % 32 or int8_activations):
            raise ValueError("GroupedInt8Linear: levels need 4-bit codes in groups of 32s, on the float kernel")
        if weight.bits == 4 and self.group_size % 32 == 0:
            codes, self.signed_codes = pack_nibbles(weight.qweight), False
        else:
            codes = weight.qweight.to(torch.int8).contiguous()
            self.signed_codes = bool((codes < 0).any())  # the integer kernel's two forms
        self.register_buffer("qweight", codes, persistent=False)
        levels = weight.levels if weight.levels is not None else NO_TENSOR
        self.register_buffer("levels", levels.to(torch.int8).contiguous(), persistent=False)
        scales = weight.scales.float().reshape(self.out_features, -1).contiguous()
        if weight.levels is not None and weight.minimums is None:
            scales = exponent_bytes(scales)
        self.register_buffer("scales", scales, persistent=False)
        minimums = weight.minimums if weight.minimums is not None else torch.empty(0)
        self.register_buffer("minimums", minimums.float().contiguous(), persistent=False)
        self.int8_activations = int8_activations
        self.int8_activation_max_rows = INT8_ACTIVATIONS_MAX_ROWS  # past it, the exact kernel

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations and x.shape[0] <= self.int8_activation_max_rows:
            return self.ops.int8_dot_linear(x, self.qweight, self.scales, self.minimums, self.group_size,
                                            self.signed_codes)
        return self.ops.grouped_int8_linear(x, self.qweight, self.scales, self.minimums, self.group_size, self.levels)

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any:
        kernel = "int8_dot" if self.int8_activations else "grouped_int8"
        return ops.LinearPart(kernel, self.qweight, self.scales, self.minimums, self.group_size, self.signed_codes,
                              bias, 0, self.levels if self.levels.numel() else None)


def exponent_bytes(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales that are all normal powers of two (MXFP4's) as their exponent bytes e (each 2^(e - 127), the
    float's own exponent bits: uint8, a quarter of the bytes), which the grouped kernel reads; other scales as
    they are."""
    bits = scales.view(torch.int32)
    exponents = (bits >> 23) & 0xFF
    if not bool(((bits & ~0x7F800000) == 0).all() and (exponents > 0).all() and (exponents < 255).all()):
        return scales
    return exponents.to(torch.uint8)


class Fp8Linear(KernelLinear):
    kernel = "fp8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.register_buffer("qweight", weight.qweight.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.to(dtype), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.qweight.to(self.dtype).T) * self.scales


class DequantizedLinear(KernelLinear):
    kernel = "dequantized"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.register_buffer("dense", dequantize(weight).to(dtype), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dense.T
