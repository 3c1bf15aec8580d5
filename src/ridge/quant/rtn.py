"""Weight-only quantization of a linear layer's [out, in] matrix by rounding to nearest (RTN).

int8: symmetric, one scale per output channel: w ~ q * scale, q in [-127, 127].
int4: asymmetric, per group of `group_size` input columns: w ~ q * scale + minimum, q in [0, 15], in one
      of two forms:
      - a float minimum (llama.cpp's Q4_1 form): the grid spans the group's own range, its minimum a float16
        number. What ridge quantizes to at load (torch's int4 kernel takes a float zero per group).
      - minimum = -zero * scale with an integer zero point: the range widened to hold 0, which lands on a
        code. The only form GPTQ / AWQ checkpoints can store (qzeros), so `ridge quantize` writes it.
      The float form costs nothing at run time and is the more accurate: on SmolLM2, whose file is Q4_1,
      RTN at group 32 finds each block's own grid again (+0.06% perplexity) where the integer form, which
      shifts every group by up to half a step, gave +24% (docs/notes/bench-quantization.md).
fp8: e4m3 codes, one scale per output channel: w ~ q * scale, |q| <= 448.
GPTQ and AWQ choose the same formats with a smarter q (and, for AWQ, scaled columns); they reuse
QuantizedWeight and dequantize() from here.

int8 and fp8 take an optional importance per input column (the mean of x^2 over calibration text, llama.cpp's
"imatrix"); with it, each row's scale is the one of a few candidates, none clipping the row, with the least
importance-weighted squared error (importance_weighted_scales). The codes stay the nearest ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    codes per group (quant/gguf_blocks.py). With `levels`, a 4-bit code is an index: w = levels[q] * scale
    (MXFP4, quant/mxfp4.py)."""

    qweight: torch.Tensor  # uint8 in [0, 15] (4 bits), int8, or float8_e4m3fn (fp8); [N, K]
    scales: torch.Tensor  # float32 [N] (per channel) or [N, K / group_size]
    minimums: torch.Tensor | None  # like scales; None: zero
    bits: int
    group_size: int | None  # None: per output channel
    levels: torch.Tensor | None = None  # int8 [16]: the value of each 4-bit code; None: the code itself

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


def check_group_size(in_features: int, group_size: int, where: str = "") -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if in_features % group_size:
        fits = [str(g) for g in GROUP_SIZES if in_features % g == 0]
        hint = (f"choose one that does (of {', '.join(fits)})" if fits else
                f"none of {', '.join(map(str, GROUP_SIZES))} does: quantize per channel (int8 or fp8)")
        raise ValueError(f"group_size: {group_size} does not divide the input dimension {in_features}{where}; {hint}")


def nearest_int8(u: torch.Tensor) -> torch.Tensor:
    """The nearest int8 code to each weight / scale, as float32."""
    return torch.round(u).clamp(-127, 127)


def nearest_fp8(u: torch.Tensor) -> torch.Tensor:
    """The nearest e4m3 number to each weight / scale, as float32."""
    return u.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def quantize_int8(weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """Codes and a scale per row, a few million weights at a time (rows are independent): a vocabulary projection's
    float32 temporaries would otherwise take several times its size."""
    codes, scales = [], []
    for rows in weight.split(max(1, (1 << 22) // weight.shape[1])):
        w = rows.float()
        part = storable_scale(w.abs().amax(dim=1) / 127)
        if importance is not None:
            part = importance_weighted_scales(w, importance, part, INT8_STRETCHES, nearest_int8, uniform_steps=True)
        codes.append(nearest_int8(w / part[:, None]).to(torch.int8))
        scales.append(part)
    return QuantizedWeight(torch.cat(codes), torch.cat(scales), None, 8, None)


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
    if integer_zeros:
        return scales, torch.round(-low / scales).clamp(0, 15)
    # a float minimum is a float16 number, as its scale is: what the CUDA kernels hold and GGUF's Q4_1 stores
    return scales, -low.half().float() / scales


def int4_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The nearest of the 16 levels (q - zero) * scale to each weight (float codes in [0, 15]); w [..., G]
    and its group's scales and zeros [...]."""
    return torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, 15)


def quantize_int4(weight: torch.Tensor, group_size: int, integer_zeros: bool = False) -> QuantizedWeight:
    n, k = weight.shape
    scales, zeros = int4_grid(weight, group_size, integer_zeros)
    q = int4_codes(weight.float().view(n, k // group_size, group_size), scales, zeros).to(torch.uint8)
    return QuantizedWeight(q.view(n, k), scales, -zeros * scales, 4, group_size)


def quantize_fp8(weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedWeight:
    w = weight.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    if importance is not None:
        scales = importance_weighted_scales(w, importance, scales, FP8_STRETCHES, nearest_fp8, uniform_steps=False)
    return QuantizedWeight((w / scales[:, None]).to(torch.float8_e4m3fn), scales, None, 8, None)


# The candidate scales, as multiples of the row's largest |w| over the largest code: never below 1, so that no
# weight is clipped (a column quiet on the calibration text may be loud on other text). int8: up to a quarter
# wider, its levels coarser for the rest of the row; fp8: one octave, over which e4m3's relative grid slides
# through all its positions while every weight keeps its relative precision. Fine enough that a column can land
# within an eighth of a step of a level, even where its code is near the largest one.
INT8_STRETCHES = torch.linspace(1.0, 1.25, 129).tolist()
FP8_STRETCHES = torch.exp2(torch.arange(128) / 128).tolist()
IMPORTANT_COLUMNS = 128  # the columns rounded at every candidate scale; the rest enter by their expected error
SEARCH_ROWS = 1024  # rows searched together: [1024, 128] float32 is half a megabyte


def importance_weighted_scales(w: torch.Tensor, importance: torch.Tensor, base: torch.Tensor,
                               stretches: list[float], codes: Callable[[torch.Tensor], torch.Tensor],
                               uniform_steps: bool) -> torch.Tensor:
    """Each row's scale among base * stretch with the least sum_j importance_j (w_j - q_j * scale)^2, the
    error of the layer's output on inputs whose column j has mean square importance_j.

    On real models a few input columns carry most of the importance (SmolLM2's layer 11 down projection: two
    of 1,536 columns, mean squares ~1e6 times the median's, all of RTN's weighted error), and the scale that
    puts their weights on levels removes it. Those columns are rounded at each candidate; the others' error
    is its expectation: a uniform rounding error of one step, step^2 / 12 times their importance, for
    integer levels (uniform_steps); for fp8, whose error is relative to each weight, a constant left out."""
    top = importance.topk(min(IMPORTANT_COLUMNS, importance.numel())).indices
    a_top = importance[top].float()
    rest = float(importance.sum() - a_top.sum()) / 12 if uniform_steps else 0.0
    chosen = torch.empty_like(base)
    for rows in torch.arange(w.shape[0]).split(SEARCH_ROWS):  # each chunk's columns stay in cache over the candidates
        w_top, row_base = w[rows][:, top], base[rows]
        best_scales, best_error = row_base, torch.full_like(row_base, float("inf"))
        for stretch in stretches:
            scales = storable_scale(row_base * stretch) if uniform_steps else row_base * stretch
            error = torch.addcmul(w_top, codes(w_top / scales[:, None]), scales[:, None], value=-1).square_() @ a_top
            if rest:
                error += rest * scales.square()
            better = error < best_error
            best_scales, best_error = torch.where(better, scales, best_scales), torch.where(better, error, best_error)
        chosen[rows] = best_scales
    return chosen


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
    codes = qw.qweight if qw.levels is None else qw.levels[qw.qweight.long()]
    if qw.group_size is None:
        return codes.float() * qw.scales[:, None]
    n, k = qw.shape
    w = codes.float().view(n, k // qw.group_size, qw.group_size) * qw.scales[..., None]
    if qw.minimums is not None:
        w += qw.minimums[..., None]
    return w.view(n, k)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack weights along the output dimension (q|k|v, gate|up), or None where their formats differ."""
    first = parts[0]
    if any((p.bits > 4) != (first.bits > 4) or p.group_size != first.group_size
           or p.qweight.is_floating_point() != first.qweight.is_floating_point()
           or (p.levels is None) != (first.levels is None)
           or (p.levels is not None and not torch.equal(p.levels, first.levels)) for p in parts):
        return None
    minimums = None
    if any(p.minimums is not None for p in parts):
        minimums = torch.cat([torch.zeros_like(p.scales) if p.minimums is None else p.minimums for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), minimums,
                           max(p.bits for p in parts), first.group_size, first.levels)


def with_codes_as_levels(qw: QuantizedWeight) -> QuantizedWeight:
    """A weight with levels as plain int8 codes, a byte each, for kernels that have no table (the same numbers;
    twice the bytes of 4-bit codes)."""
    if qw.levels is None:
        return qw
    wide = int(qw.levels.abs().max()).bit_length() + 1  # the bits the levels span, with a sign
    levels = qw.levels.to(qw.qweight.device)
    return dataclasses.replace(qw, qweight=levels[qw.qweight.long()].contiguous(), bits=max(wide, 5), levels=None)


def cut_quantized(key: str, weight: QuantizedWeight, dim: int, index: torch.Tensor,
                  pad_to: int | None = None) -> QuantizedWeight:
    """The rows (dim 0, padded with zero rows to pad_to) or columns (dim 1) `index` of a quantized weight (a
    tensor-parallel rank's part of it, cluster/shards.py): columns only on the boundaries of its scale groups."""
    if dim == 0:
        cut = dataclasses.replace(
            weight, qweight=weight.qweight[index], scales=weight.scales[index],
            minimums=None if weight.minimums is None else weight.minimums[index])
        if pad_to is not None and len(index) < pad_to:
            cut = dataclasses.replace(
                cut, qweight=pad_rows(cut.qweight, pad_to), scales=pad_rows(cut.scales, pad_to),
                minimums=None if cut.minimums is None else pad_rows(cut.minimums, pad_to))
        return cut
    if weight.group_size is None:  # one scale per output row: the columns cut alone
        return dataclasses.replace(weight, qweight=weight.qweight[:, index])
    group = weight.group_size
    if index[0] % group or len(index) % group:
        raise ValueError(f"tensor_parallel_size: {key}'s columns {int(index[0])}.. are cut inside a quantization "
                         f"group of {group}; choose a tensor_parallel_size (or, quantizing at load, a "
                         "quantization_group_size) that divides the cut")
    groups = index[::group] // group
    return dataclasses.replace(weight, qweight=weight.qweight[:, index], scales=weight.scales[:, groups],
                               minimums=None if weight.minimums is None else weight.minimums[:, groups])


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the last vocabulary shard of a tensor-parallel rank, to the others'
    count)."""
    if len(t) >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - len(t), *t.shape[1:]))])
