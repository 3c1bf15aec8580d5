"""Dense weights on the CPU: float32 on ridge's few-row kernel, bfloat16 on oneDNN's packed layout.

float32: torch's linear at decode's shapes is MKL's sgemv on one thread; ridge's kernel
(kernels/dense_linear.cpp), on every thread, is the faster one up to FEW_ROWS rows, torch's sgemm past
them. Batch invariant, every call runs on the kernel, FEW_ROWS rows at a time: sgemm's result for a row
changes with the number of rows beside it (kernels/batch_invariance.py).

bfloat16: torch's plain matmul re-lays out the weight on every call; oneDNN's packed format is what its
AMX / AVX512-BF16 kernels read directly, faster at decode's one row and at prompts' hundreds. float32
gains nothing from packing. Where oneDNN cannot pack bf16 (CPUs without AVX512), torch's bf16 matmul is
a slow generic loop, several times float32's sgemm: bf16 weights take the float32 layer's road
there, the few-row kernel widening them as it reads, and prompts' rows multiplied by slices of the weight
widened to float32. (docs/notes/kernel-choices.md has the measurements.)
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ridge.linear.base import NO_TENSOR
from ridge.linear.rows import FEW_ROWS

# the output channels of a bf16 weight widened to float32 at a time for a prompt's rows: a slice stays a few MiB
# where a whole vocabulary head widened at once would be hundreds
WIDENED_CHANNELS = 2048


class FewRowsLinear(nn.Linear):
    """An nn.Linear (same parameters, same results up to summation order) with a faster few-row path;
    float32, or bfloat16 where oneDNN does not pack it (onednn_packs)."""

    kernel = "dense"
    ops: ModuleType
    every_row: bool  # every call on the kernel, FEW_ROWS rows at a time (batch invariance)

    @classmethod
    def wrap(cls, weight: nn.Parameter, bias: nn.Parameter | None, ops: ModuleType,
             every_row: bool = False) -> FewRowsLinear:
        """Around existing parameters, without a copy (a tied output projection shares the embeddings')."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight, layer.bias, layer.ops, layer.every_row = weight, bias, ops, every_row
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.shape[0] <= FEW_ROWS:
            out = self.ops.dense_linear(rows, self.weight, self.bias)
        elif self.every_row:
            out = torch.cat([self.ops.dense_linear(tile, self.weight, self.bias) for tile in rows.split(FEW_ROWS)])
        elif self.weight.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)
        else:
            out = widened_linear(rows, self.weight, self.bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any:
        return ops.LinearPart("dense", self.weight, NO_TENSOR, NO_TENSOR, 0, False, bias, 0)


def widened_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight.T (+ bias) for many bf16 rows: sgemm over the weight widened to float32 a slice of channels
    at a time (the slice's conversion is a small part of its matmul at a prompt's rows), rounded to bf16 once."""
    wide = rows.float()
    out = torch.cat([F.linear(wide, part.float()) for part in weight.split(WIDENED_CHANNELS)], dim=-1)
    if bias is not None:
        out += bias
    return out.to(rows.dtype)


def onednn_packs(dtype: torch.dtype, device: str) -> bool:
    """Whether oneDNN can hold bf16 weights packed here."""
    return (
        device == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _packs_bf16()
    )


@cache
def _packs_bf16() -> bool:
    """oneDNN packs bf16 weights only on CPUs with AVX512BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU
    raises): asked by packing a small weight once."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """Drop-in for nn.Linear holding a oneDNN-packed weight (opaque; not a regular tensor).

    min_rows: calls with fewer rows are padded to this many. oneDNN multiplies a single row on another
    path than several, whose sums for a row can differ in the last bits while every count from two up
    agrees; batch invariance pads single rows to two (kernels/batch_invariance.py, docs/notes/batch-invariance.md).
    """

    kernel = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = 1) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch-size hint 1: the packing chosen for decode was also the fastest at batch 64-256
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias
        self.min_rows = min_rows
        self._bytes = weight.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = count < self.min_rows
        if padded:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - count, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return (out[:count] if padded else out).view(*lead, self.out_features)

    @property
    def weight_bytes(self) -> int:
        return self._bytes

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any:
        part = ops.LinearPart("onednn", self.packed, NO_TENSOR, NO_TENSOR, 0, False, bias, 0)
        part.min_rows = self.min_rows
        return part


# A prompt scratch holds a whole weight in bf16; a larger weight (a 7B model's MLP) keeps ridge's plain tiles
# (kernels/quant_linear.cpp), which write their outputs in place where a packed matmul's, tile by tile, would have
# to be copied.
PROMPT_SCRATCH_MAX_BYTES = 64 << 20
CHANNEL_BLOCK = 64  # the channels per block of the packed layout ridge writes (quant_linear.cpp's kOnednnBlock)


def prompt_scratch(out_features: int, in_features: int, ops: ModuleType) -> torch.Tensor | None:
    """An [out, in] bf16 weight in oneDNN's packed form for quantized layers of that shape to dequantize into
    before a prompt's matmul (ops.vnni_dequantize_onednn_), or None where that does not fit or oneDNN packs the
    shape otherwise than ridge writes it. Which: a random weight packed by oneDNN is compared, byte for byte, with
    the same weight in ridge's layout, channels in blocks of 64 and each block's columns in pairs."""
    if out_features % CHANNEL_BLOCK or in_features % 2 or 2 * out_features * in_features > PROMPT_SCRATCH_MAX_BYTES:
        return None
    probe = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)  # the batch-size hint PackedLinear packs with
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != probe.nbytes:
        return None
    ridge_layout = probe.view(out_features // CHANNEL_BLOCK, CHANNEL_BLOCK, in_features // 2, 2).transpose(1, 2)
    onednn_layout = ops.onednn_bytes(packed, nbytes).view(torch.bfloat16).view(ridge_layout.shape)
    return packed if torch.equal(onednn_layout, ridge_layout) else None
