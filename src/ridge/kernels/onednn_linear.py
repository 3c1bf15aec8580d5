"""bf16 linear layers on oneDNN with prepacked weights (CPU).

torch's plain bf16 matmul re-lays out the weight on every call; oneDNN's packed format is what its
AMX / AVX512-BF16 kernels read directly, faster at decode's one row and at prompts' hundreds
(docs/notes/kernel-choices.md). fp32 gains nothing from packing, so only bf16 is packed.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
from torch import nn

from ridge.models.transformer import DecoderModel


def available(dtype: torch.dtype, device: str) -> bool:
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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = 1) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch-size hint 1: the packing chosen for decode was also the fastest at batch 64-256
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = count < self.min_rows
        if padded:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - count, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return (out[:count] if padded else out).view(*lead, self.out_features)


def pack_linears(model: DecoderModel, min_rows: int = 1) -> DecoderModel:
    """Swap every nn.Linear of the decoder layers and the output projection for a PackedLinear, in place.

    The output projection gets its own packed copy, so a tied embedding table stays a plain tensor.
    """
    model.replace_linears(lambda weight, bias: PackedLinear(weight.data, bias, min_rows))
    return model


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
