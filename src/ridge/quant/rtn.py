"""Weight-only quantization of a linear layer's [out, in] matrix by rounding to nearest (RTN).

int8: symmetric, one scale per output channel: w ~ q * scale, q in [-127, 127].
int4: asymmetric, per group of `group_size` input columns: w ~ q * scale + minimum, q in [0, 15].
GPTQ and AWQ choose the same formats with a smarter q (and, for AWQ, scaled columns); they reuse
QuantizedWeight and dequantize() from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedWeight:
    """w[n, k] = qweight[n, k] * scale + minimum, one scale (and minimum) per output channel or per group of
    `group_size` input columns. RTN makes int8 per channel and int4 per group; GGUF files bring 4- to 8-bit
    codes per group (quant/gguf_blocks.py)."""

    qweight: torch.Tensor  # uint8 in [0, 15] (4 bits), else int8; [N, K]
    scales: torch.Tensor  # float32 [N] (per channel) or [N, K / group_size]
    minimums: torch.Tensor | None  # like scales; None: zero
    bits: int
    group_size: int | None  # None: per output channel

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


def check_group_size(in_features: int, group_size: int, where: str = "") -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if in_features % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the input dimension {in_features}{where}; "
                         f"choose one that does (of {', '.join(str(g) for g in GROUP_SIZES if in_features % g == 0)})")


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scales, None, 8, None)


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    n, k = weight.shape
    check_group_size(k, group_size)
    w = weight.float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(q.view(n, k), scales, low, 4, group_size)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """float32 [N, K]: the matrix the quantized layer multiplies by."""
    if qw.group_size is None:
        return qw.qweight.float() * qw.scales[:, None]
    n, k = qw.shape
    w = qw.qweight.float().view(n, k // qw.group_size, qw.group_size) * qw.scales[..., None]
    if qw.minimums is not None:
        w += qw.minimums[..., None]
    return w.view(n, k)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack weights along the output dimension (q|k|v, gate|up), or None where their formats differ."""
    first = parts[0]
    if any((p.bits > 4) != (first.bits > 4) or p.group_size != first.group_size for p in parts):
        return None
    minimums = None
    if any(p.minimums is not None for p in parts):
        minimums = torch.cat([torch.zeros_like(p.scales) if p.minimums is None else p.minimums for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), minimums,
                           max(p.bits for p in parts), first.group_size)
