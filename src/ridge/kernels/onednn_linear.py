"""bf16 linear layers on oneDNN with prepacked weights (CPU).

torch's plain bf16 matmul re-lays out the weight on every call; oneDNN's packed format is what its
AMX / AVX512-BF16 kernels read directly. Measured on the 2-core Sapphire Rapids box
(docs/benchmarks.md): a 576x3072 layer at batch 1 reads 20 GB/s packed vs 12 GB/s plain, and at
batch 256 runs 1.16 TFLOP/s vs 0.93. fp32 gains nothing from packing, so only bf16 is packed.
"""

from __future__ import annotations

from functools import cache

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
    """Drop-in for nn.Linear holding a oneDNN-packed weight (opaque; not a regular tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch-size hint 1: the packing chosen for decode was also the fastest at batch 64-256
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                                 "none", [], "")
        return out.view(*lead, self.out_features)


def pack_linears(model: DecoderModel) -> DecoderModel:
    """Swap every nn.Linear of the decoder layers and the output projection for a PackedLinear, in place.

    The output projection gets its own packed copy, so a tied embedding table stays a plain tensor.
    """
    model.replace_linears(lambda weight, bias: PackedLinear(weight.data, bias))
    return model
