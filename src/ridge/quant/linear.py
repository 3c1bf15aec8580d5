"""Linear layers over quantized weights, and the swap that puts them into a model.

On the CPU both formats run on torch's own weight-only kernels, the ones gpt-fast and torchao use:
int8 through aten._weight_int8pack_mm (int8 [N, K] with per-channel scales, activations bf16/fp32) and
int4 through aten._weight_int4pack_mm_for_cpu (a tiled, packed layout that torch converts to at load;
the kernel dequantizes a tile in registers and multiplies it, so memory only streams the 4-bit codes).
Elsewhere, or where a kernel refuses a shape, a layer multiplies by its dequantized matrix: the same
numbers, the plain path's speed.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ridge.models.transformer import DecoderModel
from ridge.quant.rtn import QuantizedWeight, dequantize, quantize_int4, quantize_int8

log = logging.getLogger("ridge")


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(weight).T + bias, computed by the format's kernel where one runs."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 use_kernel: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype = dtype
        self.bias = bias
        self.kernel = use_kernel and weight.qweight.device.type == "cpu"
        if self.kernel and self.bits == 8:
            self.register_buffer("qweight", weight.qweight.contiguous())
            self.register_buffer("scales", weight.scales.to(dtype))
        elif self.kernel:
            # the kernel packs rows by 16: pad with zero rows, whose outputs forward() drops
            pad = -self.out_features % 16
            codes = nn.functional.pad(weight.qweight.to(torch.int32), (0, 0, 0, pad)).contiguous()
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            # its zero point is the value of code 8: w = (q - 8) * scale + zero
            zeros = weight.minimums + 8 * weight.scales
            pairs = nn.functional.pad(torch.stack([weight.scales, zeros], dim=-1), (0, 0, 0, 0, 0, pad))
            self.register_buffer("scales_and_zeros", pairs.transpose(0, 1).contiguous().to(dtype))  # [groups, N, 2]
        else:
            self.register_buffer("dense", dequantize(weight).to(dtype))

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass streams from memory for the weight."""
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            return n * k + 2 * n
        return n * k // 2 + n * (k // self.group_size) * 2 * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        if not self.kernel:
            out = x2 @ self.dense.T
        elif self.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)
            out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)


def quantize_weight(weight: torch.Tensor, method: str, group_size: int) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight, group_size)
    raise ValueError(f"quantization: {method!r} is not one of int8, int4")


def quantize_model(model: DecoderModel, method: str, group_size: int, dtype: torch.dtype,
                   use_kernel: bool = True) -> DecoderModel:
    """Swap every nn.Linear of the decoder layers, and the output projection, for a QuantizedLinear in place
    (RTN). The embedding table stays as it is: a lookup reads one row per token, not the whole table."""
    model.output_projection = QuantizedLinear(quantize_weight(model.output_weight.data, method, group_size), None,
                                              dtype, use_kernel)
    for parent in list(model.layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                qw = quantize_weight(child.weight.data, method, group_size)
                setattr(parent, name, QuantizedLinear(qw, child.bias, dtype, use_kernel))
    return model
