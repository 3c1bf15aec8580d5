"""Quantized weights in pack_vnni's layout (linear/layouts.py), on two kernels that read it.

- Bf16DotLinear: exact, on AVX512-BF16 dot products (kernels/bf16_dot_linear.cpp), the weight's own scales
  in float16: 4-bit codes per group of 32s, 8-bit ones per channel or per group of 32s or of 16 (GGUF's Q6_K);
  exact but for a decode batch's rows of 8-bit codes in groups, which multiply the weight rounded to bf16 as a
  bf16 model's. From BF16_DOT_TILED_MIN_ROWS rows (prompts) the weight is dequantized to bf16 in oneDNN's
  packed form, a scratch shared by the layers of its shape (share_prompt_scratch), and multiplied on oneDNN's
  kernels as a bf16 model's packed weights are; else in tiles.
- VnniLinear: int8 activations (EngineConfig.int8_activations) on AVX512-VNNI: the input quantized to int8
  per 32 values and multiplied as integers at every row count (kernels/vnni_linear.cpp): at batch 32 a bf16
  matmul is bound by arithmetic, and integer products keep 4-bit weights ahead of it. Not exact (1-2% error
  in a layer's output), as llama.cpp's CPU arithmetic.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ridge.linear.base import KernelLinear
from ridge.linear.layouts import pack_vnni
from ridge.linear.rows import BF16_DOT_TILED_MIN_ROWS
from ridge.quant.rtn import QuantizedWeight


def vnni_fits(weight: QuantizedWeight) -> bool:
    """pack_vnni's layout takes output channels in blocks of 16, inputs in chunks of 32 columns, and groups of
    32s or of 16 (4-bit codes in groups of 16 only as bytes: two a byte needs 32 columns a group)."""
    n, k = weight.shape
    group = weight.group_size or k
    return n % 16 == 0 and k % 32 == 0 and weight.qweight.dtype != torch.float8_e4m3fn and (
        group % 32 == 0 or group == 16)


class VnniLayoutLinear(KernelLinear):
    """Codes [N, K] with their scales and minimums as the layer's only weight: pack_vnni's layout (self.qweight,
    and self.vnni, ridge's handle on the same bytes)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, ops: ModuleType) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.ops = ops
        self.bits = weight.bits
        group = weight.group_size or self.in_features
        nibbles = weight.bits == 4 and group % 32 == 0  # two 4-bit codes a byte
        codes = weight.qweight if nibbles else weight.qweight.to(torch.int8)
        signed = not nibbles and bool((codes < 0).any())
        # vpdpbusd's unsigned operand, code + 128: the sign bit flipped, in place of a widening to int16 (a
        # vocabulary projection's codes would take twice their size again, twice)
        stored = codes.view(torch.uint8) ^ 0x80 if signed else codes
        minimums = None if weight.minimums is None else weight.minimums.reshape(self.out_features, -1)
        packed, unit = pack_vnni(stored, 4 if nibbles else 8, weight.scales.reshape(self.out_features, -1), minimums,
                                 group)
        self.register_buffer("qweight", packed, persistent=False)
        # GGUF's 5- and 6-bit codes fit 7 bits: bf16_dot_linear takes each as one bf16, not as two nibbles
        low, high = (-64, 63) if signed else (0, 127)
        seven_bit = not nibbles and low <= int(codes.min()) and int(codes.max()) <= high
        self.vnni = ops.VnniWeight(packed, group, nibbles, signed, minimums is not None, unit, seven_bit)
        self.group_size, self.signed_codes = group, signed

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any:
        return ops.LinearPart(self.kernel, self.vnni, bias, BF16_DOT_TILED_MIN_ROWS)


class Bf16DotLinear(VnniLayoutLinear):
    kernel = "bf16_dot"
    prompt_scratch: torch.Tensor | None = None  # share_prompt_scratch's, for a prompt's rows

    @staticmethod
    def fits(weight: QuantizedWeight) -> bool:
        group = weight.group_size or weight.shape[1]
        return vnni_fits(weight) and (group % 32 == 0 or weight.bits != 4)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < BF16_DOT_TILED_MIN_ROWS:
            return self.ops.bf16_dot_linear(x, self.vnni)
        if self.prompt_scratch is not None:
            self.ops.vnni_dequantize_onednn_(self.prompt_scratch, self.vnni)
            return torch.ops.mkldnn._linear_pointwise(x, self.prompt_scratch, None, "none", [], "")
        return self.ops.vnni_tiled_linear(x, self.vnni)


class VnniLinear(VnniLayoutLinear):
    kernel = "vnni"
    int8_activations = True

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.vnni_linear(x, self.vnni)
