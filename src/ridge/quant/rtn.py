"""Weight-only quantization of a linear layer's [out, in] matrix by rounding to nearest (RTN).

int8: symmetric, one scale per output channel: w ~ q * scale, q in [-127, 127].
int4: asymmetric, per group of `group_size` input columns: w ~ q * scale + minimum, q in [0, 15], in one
      of two forms:
      - a float minimum (llama.cpp's Q4_1 form): the grid spans the group's own range. What ridge
        quantizes to at load (torch's int4 kernel takes a float zero per group).
      - minimum = -zero * scale with an integer zero point: the range widened to hold 0, which lands on a
        code. The only form GPTQ / AWQ checkpoints can store (qzeros), so `ridge quantize` writes it.
      The float form costs nothing at run time and is the more accurate: on SmolLM2, whose file is Q4_1,
      RTN at group 32 finds each block's own grid again (+0.06% perplexity) where the integer form, which
      shifts every group by up to half a step, gave +24% (docs/benchmarks.md).
fp8: e4m3 codes, one scale per output channel: w ~ q * scale, |q| <= 448.
GPTQ and AWQ choose the same formats with a smarter q (and, for AWQ, scaled columns); they reuse
QuantizedWeight and dequantize() from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128)


def storable_scale(value: torch.Tensor) -> torch.Tensor:
    """Integer formats' scales are float16 numbers (held in float32), so that the checkpoint layouts,
    which store float16 scales, hold them exactly (quant/checkpoint.py)."""
    return value.clamp(min=1e-7).half().float()


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass
class QuantizedWeight:
    """w[n, k] = qweight[n, k] * scale + minimum, one scale (and minimum) per output channel or per group of
    `group_size` input columns. RTN makes int8 per channel and int4 per group; GGUF files bring 4- to 8-bit
    codes per group (quant/gguf_blocks.py)."""

    qweight: torch.Tensor  # uint8 in [0, 15] (4 bits), int8, or float8_e4m3fn (fp8); [N, K]
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
    scales = storable_scale(w.abs().amax(dim=1) / 127)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scales, None, 8, None)


def int4_grid(weight: torch.Tensor, group_size: int, integer_zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of input columns: (scales, zero points), both [N, K / group_size]; w ~ (q - zero) * scale.
    integer_zeros: the range widened to hold 0 and the zero point rounded (checkpoints); else the group's
    own range, with the zero point -minimum / scale as it falls."""
    n, k = weight.shape
    check_group_size(k, group_size)
    grouped = weight.float().view(n, k // group_size, group_size)
    low, high = grouped.amin(dim=2), grouped.amax(dim=2)
    if integer_zeros:
        low, high = low.clamp(max=0), high.clamp(min=0)
    scales = storable_scale((high - low) / 15)
    zeros = -low / scales
    return scales, torch.round(zeros).clamp(0, 15) if integer_zeros else zeros


def int4_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The nearest of the 16 levels (q - zero) * scale to each weight (float codes in [0, 15]); w [..., G]
    and its group's scales and zeros [...]."""
    return torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, 15)


def quantize_int4(weight: torch.Tensor, group_size: int, integer_zeros: bool = False) -> QuantizedWeight:
    n, k = weight.shape
    scales, zeros = int4_grid(weight, group_size, integer_zeros)
    q = int4_codes(weight.float().view(n, k // group_size, group_size), scales, zeros).to(torch.uint8)
    return QuantizedWeight(q.view(n, k), scales, -zeros * scales, 4, group_size)


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    w = weight.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return QuantizedWeight((w / scales[:, None]).to(torch.float8_e4m3fn), scales, None, 8, None)


def zero_points(qw: QuantizedWeight) -> torch.Tensor:
    """The integer zero points of an int4 weight quantized with integer_zeros (minimum = -zero * scale), for
    checkpoints."""
    if qw.minimums is None:
        return torch.zeros_like(qw.scales)
    zeros = torch.round(-qw.minimums / qw.scales)
    if not torch.allclose(-zeros * qw.scales, qw.minimums, rtol=1e-5, atol=1e-7):
        raise ValueError("weight: its minimums are not integer zero points times the scale (a GGUF Q4_1 / Q4_K "
                         "tensor, or int4 quantized with float minimums?); GPTQ / AWQ checkpoints cannot store it")
    return zeros


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
    if any((p.bits > 4) != (first.bits > 4) or p.group_size != first.group_size
           or p.qweight.is_floating_point() != first.qweight.is_floating_point() for p in parts):
        return None
    minimums = None
    if any(p.minimums is not None for p in parts):
        minimums = torch.cat([torch.zeros_like(p.scales) if p.minimums is None else p.minimums for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), minimums,
                           max(p.bits for p in parts), first.group_size)
