"""Triton matmuls of activations by a weight-only quantized matrix, for the CUDA path (linear/triton.py).

y[M, N] = x[M, K] @ W.T with W[n, k] = code[n, k] * scale + minimum, scale and minimum per output channel
or per group of input columns: ridge's int8 (per channel), int4 / GPTQ / AWQ (4-bit per group, as nibbles)
and fp8 (e4m3 per channel) on one pair of kernels. The codes are dequantized in registers, tile by tile, so
a decode step reads the quantized bytes and nothing else: the reason to quantize on a bandwidth-bound GPU.

Codes are stored as
  - "nibbles": 4-bit codes two per byte, column j holding k = j (low nibble) and k = j + K/2 (high): each
    tile multiplies two halves of x, with no interleaving of nibbles in registers;
  - "e2m1": the same nibbles read as MXFP4's 4-bit floats (quant/mxfp4.py), doubled to the integers -12..12 by
    their bits (sign, 2-bit exponent, 1-bit mantissa), with a power-of-two scale per group of 32;
  - "bytes": one int8 / uint8 code per weight;
  - "fp8": e4m3 codes as bytes, widened to float16 either by the GPU's conversion instruction (Ada, Hopper)
    or by moving their bits (the exponent bias differs by 8: one multiply by 2^8 puts it right), which needs
    no fp8 support from the GPU or the interpreter.
Integer codes become float32 by an integer add into the mantissa of 2^23 and one float subtraction, not by
the integer-to-float instruction, which runs at a quarter of the float rate: at int8 a multiprocessor must
widen some 13 weights a cycle to keep up with HBM.

A tile is [BLOCK_N rows, GROUPS groups, COLUMNS columns] of codes, so that each group's scale and minimum
are loaded once, as a [BLOCK_N, GROUPS] block, and broadcast over the group's columns rather than gathered
per weight. Per-channel formats have one "group" per tile and their scale is applied to the output.

Two kernels, each able to split K over several programs (their float32 partial sums added after), so that
every multiprocessor streams weights however few the output channels:
  - a GEMV for a few rows (decode) that multiplies in registers; at one row it accumulates element-wise and
    sums across lanes once, at the end;
  - a tiled tl.dot on tensor cores (the rows padded to 16), in x's 16-bit type or, for float32 models, IEEE
    float32 (a dequantized weight is exact in float32; the interpreter that checks these kernels on the CPU
    has no 16-bit dot).
and, for many rows (a prefill), a third way: the weight dequantized to x's type by torch and multiplied by
torch's matmul (cuBLAS), a transient copy that costs a few bytes a weight once per call, amortised over the
rows. Which of them, with which tile and split, serves a shape and a number of rows is measured on the GPU at
its first call (quant_tuning.py); the interpreter runs DEFAULT and LARGE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NIBBLES, BYTES, FP8, E2M1 = 0, 1, 2, 3
# e2m1's 16 codes doubled: quant/mxfp4.py's LEVELS (this package imports nothing of ridge's; a test holds them equal)
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
GEMV_MAX_ROWS = 8
STEP_SHAPED = ["M", "stride_os"]  # not specialized on: the rows change from call to call (paged_attention.py says why)


@dataclass(frozen=True)
class Config:
    """How one call is cut into programs."""

    mma: bool = False  # tl.dot on tensor cores, else the GEMV
    block_n: int = 32  # output channels a program computes
    tile: int = 128  # code columns a program reads per step of its loop over K
    warps: int = 4
    programs_per_sm: int = 4  # K is split until about this many programs per multiprocessor; 0: never split
    native_fp8: bool = False  # fp8 codes widened by the GPU's instruction (compute capability 8.9 and up)
    dense: bool = False  # dequantized by torch and multiplied by cuBLAS, the fields above unused


DEFAULT = Config()
LARGE = Config(mma=True, block_n=64, tile=128, programs_per_sm=0)  # above GEMV_MAX_ROWS: enough rows to fill SMs
DENSE = Config(dense=True)


@dataclass
class PackedWeight:
    """A quantized [out_features, in_features] matrix as the kernels read it."""

    codes: torch.Tensor  # [N, code columns], as `kind` stores them
    kind: int
    scales: torch.Tensor  # [N] (group_size 0) or [N, K / group_size]; float16 or float32
    minimums: torch.Tensor | None
    group_size: int  # 0: one scale per output channel
    out_features: int

    @property
    def code_columns(self) -> int:
        return self.codes.shape[1]


@triton.jit
def _widen(codes, KIND: tl.constexpr, SIGNED: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """float32 values of codes (integers, e4m3 bits as uint8, or e2m1 nibbles doubled)."""
    if KIND == 3:  # e2m1: exponent e and mantissa m; doubled, m (e = 0) or (2 + m) * 2^(e - 1)
        magnitude = codes & 7
        exponent, mantissa = (magnitude >> 1).to(tl.int32), (magnitude & 1).to(tl.int32)
        doubled = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
        return tl.where((codes & 8) != 0, -doubled, doubled).to(tl.float32)
    if KIND == 2:
        if NATIVE_FP8:
            return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        bits = ((codes & 0x80).to(tl.int16) << 8) | ((codes & 0x7F).to(tl.int16) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    # 2^23 + c + offset has c + offset in its mantissa's low bits: add as integers, subtract as floats
    if SIGNED:
        return (codes.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return (codes.to(tl.int32) + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequantize(codes, n, group, scales_ptr, mins_ptr, stride_sn, N,
                GROUP: tl.constexpr, KIND: tl.constexpr, SIGNED: tl.constexpr, HAS_MIN: tl.constexpr,
                NATIVE_FP8: tl.constexpr):
    """float32 weights of a [BLOCK_N, GROUPS, COLUMNS] tile of codes at rows n, of groups `group` ([GROUPS] group
    indices; per-channel scales (GROUP 0) are left to the caller)."""
    w = _widen(codes, KIND, SIGNED, NATIVE_FP8)
    if GROUP > 0:
        where = n[:, None] * stride_sn + group[None, :]
        mask = (n < N)[:, None]
        w = w * tl.load(scales_ptr + where, mask=mask, other=0.0).to(tl.float32)[:, :, None]
        if HAS_MIN:
            w = w + tl.load(mins_ptr + where, mask=mask, other=0.0).to(tl.float32)[:, :, None]
    return w


@triton.jit
def _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn, stride_sn, N,
          GROUP: tl.constexpr, KIND: tl.constexpr, SIGNED: tl.constexpr, HAS_MIN: tl.constexpr,
          NATIVE_FP8: tl.constexpr, GROUPS: tl.constexpr, COLUMNS: tl.constexpr, EVEN: tl.constexpr):
    """The float32 weights of the tile of code columns [start, start + GROUPS * COLUMNS), 3-D, and their
    columns: (low weights, high weights (nibbles; else the low ones again), columns [GROUPS, COLUMNS], in-range
    mask of them). EVEN: the tile lies inside [start, last) (no column mask)."""
    g = tl.arange(0, GROUPS)
    e = tl.arange(0, COLUMNS)
    j = start + g[:, None] * COLUMNS + e[None, :]  # [GROUPS, COLUMNS]
    j_in = j < last
    pointers = codes_ptr + n[:, None, None] * stride_cn + j[None, :, :]
    if EVEN:
        codes = tl.load(pointers, mask=(n < N)[:, None, None], other=0)
    else:
        codes = tl.load(pointers, mask=(n < N)[:, None, None] & j_in[None, :, :], other=0)
    group = start // COLUMNS + g  # with GROUP > 0, COLUMNS == GROUP
    if KIND == 0 or KIND == 3:  # two codes a byte
        low = _dequantize(codes & 0xF, n, group, scales_ptr, mins_ptr, stride_sn, N, GROUP, KIND, SIGNED,
                          HAS_MIN, NATIVE_FP8)
        high = _dequantize(codes >> 4, n, group + code_columns // COLUMNS, scales_ptr, mins_ptr, stride_sn, N,
                           GROUP, KIND, SIGNED, HAS_MIN, NATIVE_FP8)
        if not EVEN:  # a minimum makes padding codes nonzero weights
            low = tl.where(j_in[None, :, :], low, 0.0)
            high = tl.where(j_in[None, :, :], high, 0.0)
        return low, high, j, j_in
    w = _dequantize(codes, n, group, scales_ptr, mins_ptr, stride_sn, N, GROUP, KIND, SIGNED, HAS_MIN, NATIVE_FP8)
    if not EVEN:
        w = tl.where(j_in[None, :, :], w, 0.0)
    return w, w, j, j_in


@triton.jit(do_not_specialize=STEP_SHAPED)
def _gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, code_columns, columns_per_split,
    stride_xm, stride_cn, stride_sn, stride_os, stride_om,
    GROUP: tl.constexpr, KIND: tl.constexpr, SIGNED: tl.constexpr, HAS_MIN: tl.constexpr,
    NATIVE_FP8: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    COLUMNS: tl.constexpr, EVEN: tl.constexpr,
):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    first = split * columns_per_split
    last = tl.minimum(first + columns_per_split, code_columns)
    if ROWS == 1:  # products summed element-wise, across lanes once at the end
        wide = tl.zeros([BLOCK_N, GROUPS, COLUMNS], tl.float32)
        for start in range(first, last, GROUPS * COLUMNS):
            w, high, j, j_in = _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn,
                                     stride_sn, N, GROUP, KIND, SIGNED, HAS_MIN, NATIVE_FP8, GROUPS, COLUMNS, EVEN)
            x = tl.load(x_ptr + j, mask=j_in, other=0.0).to(tl.float32)
            wide += w * x[None, :, :]
            if KIND == 0 or KIND == 3:
                x_high = tl.load(x_ptr + j + code_columns, mask=j_in, other=0.0).to(tl.float32)
                wide += high * x_high[None, :, :]
        acc = tl.sum(tl.sum(wide, 2), 1)[None, :]
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for start in range(first, last, GROUPS * COLUMNS):
            w, high, j, j_in = _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn,
                                     stride_sn, N, GROUP, KIND, SIGNED, HAS_MIN, NATIVE_FP8, GROUPS, COLUMNS, EVEN)
            for m in tl.static_range(ROWS):
                x_mask = j_in & (m < M)
                x = tl.load(x_ptr + m * stride_xm + j, mask=x_mask, other=0.0).to(tl.float32)
                part = tl.sum(tl.sum(w * x[None, :, :], 2), 1)
                if KIND == 0 or KIND == 3:
                    x_high = tl.load(x_ptr + m * stride_xm + j + code_columns, mask=x_mask,
                                     other=0.0).to(tl.float32)
                    part += tl.sum(tl.sum(high * x_high[None, :, :], 2), 1)
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if GROUP == 0:
        acc = acc * tl.load(scales_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (n < N)[None, :])


@triton.jit(do_not_specialize=STEP_SHAPED)
def _matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, code_columns, columns_per_split,
    stride_xm, stride_cn, stride_sn, stride_os, stride_om,
    GROUP: tl.constexpr, KIND: tl.constexpr, SIGNED: tl.constexpr, HAS_MIN: tl.constexpr,
    NATIVE_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    COLUMNS: tl.constexpr, EVEN: tl.constexpr, DOT16: tl.constexpr,
):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * columns_per_split
    last = tl.minimum(first + columns_per_split, code_columns)
    for start in range(first, last, GROUPS * COLUMNS):
        w, high, j, j_in = _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn,
                                 stride_sn, N, GROUP, KIND, SIGNED, HAS_MIN, NATIVE_FP8, GROUPS, COLUMNS, EVEN)
        flat = tl.reshape(j, [GROUPS * COLUMNS])
        x_mask = (m < M)[:, None] & tl.reshape(j_in, [GROUPS * COLUMNS])[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + flat[None, :], mask=x_mask, other=0.0)
        w_t = tl.trans(tl.reshape(w, [BLOCK_N, GROUPS * COLUMNS]))
        if DOT16:
            acc += tl.dot(x, w_t.to(x.dtype))
        else:
            acc += tl.dot(x.to(tl.float32), w_t, input_precision="ieee")
        if KIND == 0 or KIND == 3:
            x_high = tl.load(x_ptr + m[:, None] * stride_xm + flat[None, :] + code_columns, mask=x_mask, other=0.0)
            high_t = tl.trans(tl.reshape(high, [BLOCK_N, GROUPS * COLUMNS]))
            if DOT16:
                acc += tl.dot(x_high, high_t.to(x_high.dtype))
            else:
                acc += tl.dot(x_high.to(tl.float32), high_t, input_precision="ieee")
    if GROUP == 0:
        acc = acc * tl.load(scales_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_os + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 in 0..15, K even) -> [N, K / 2] bytes: k = j low, k = j + K/2 high."""
    half = codes.shape[1] // 2
    return (codes[:, :half] | (codes[:, half:] << 4)).to(torch.uint8).contiguous()


def fits(kind: int, in_features: int, group_size: int) -> bool:
    """Whether the kernels take this layout: a nibble's two halves must start groups of their own."""
    return kind not in (NIBBLES, E2M1) or (in_features % 2 == 0 and (in_features // 2) % max(group_size, 1) == 0)


def tile_shape(weight: PackedWeight, config: Config) -> tuple[int, int]:
    """(GROUPS, COLUMNS) of a tile: per-group formats put whole groups in a tile."""
    if not weight.group_size:
        return 1, config.tile
    return max(1, config.tile // weight.group_size), weight.group_size


def dequantized(weight: PackedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [N, K] in `dtype`, per-output-channel scales to apply to the product, or None where W carries them):
    the codes of a per-channel format are exact in 16 bits, so their scale is left to the [M, N] product."""
    codes = weight.codes
    if weight.kind == FP8:
        values = codes.view(torch.float8_e4m3fn)
    elif weight.kind in (NIBBLES, E2M1):
        values = torch.cat([codes & 0xF, codes >> 4], dim=1)  # column j: k = j, then k = j + K/2
        if weight.kind == E2M1:
            values = torch.tensor(E2M1_DOUBLED, dtype=torch.int8, device=codes.device)[values.long()]
    else:
        values = codes
    if not weight.group_size:
        return values.to(dtype), weight.scales
    n, k = values.shape
    grouped = values.float().view(n, k // weight.group_size, weight.group_size) * weight.scales.float()[:, :, None]
    if weight.minimums is not None:
        grouped += weight.minimums.float()[:, :, None]
    return grouped.view(n, k).to(dtype), None


def quant_matmul(x: torch.Tensor, weight: PackedWeight, config: Config, multiprocessors: int) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, out_features] in x's dtype, cut into programs as `config` says."""
    if config.dense:
        w, scales = dequantized(weight, x.dtype)
        out = x @ w.T
        return out if scales is None else (out.float() * scales.float()).to(x.dtype)
    rows, columns, n = x.shape[0], weight.code_columns, weight.out_features
    groups, group_columns = tile_shape(weight, config)
    tile = groups * group_columns
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    row_tiles = triton.cdiv(rows, block_m) if config.mma else 1
    tiles = row_tiles * triton.cdiv(n, config.block_n)
    splits = 1
    if config.programs_per_sm:
        wanted = -(-config.programs_per_sm * multiprocessors // tiles)
        splits = max(1, min(wanted, columns // (2 * tile)))
    per_split = triton.cdiv(triton.cdiv(columns, splits), tile) * tile
    splits = triton.cdiv(columns, per_split)
    out = torch.empty(splits, rows, n, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    mins = weight.minimums if weight.minimums is not None else weight.scales
    common = dict(
        GROUP=weight.group_size, KIND=weight.kind, SIGNED=weight.codes.dtype == torch.int8,
        HAS_MIN=weight.minimums is not None, NATIVE_FP8=config.native_fp8, BLOCK_N=config.block_n, GROUPS=groups,
        COLUMNS=group_columns, EVEN=columns % per_split == 0 and per_split % tile == 0, num_warps=config.warps,
    )
    args = (x, weight.codes, weight.scales, mins, out, rows, n, columns, per_split, x.stride(0),
            weight.codes.stride(0), weight.scales.stride(0) if weight.scales.dim() == 2 else 0, out.stride(0),
            out.stride(1))
    if config.mma:
        _matmul_kernel[(row_tiles, triton.cdiv(n, config.block_n), splits)](
            *args, BLOCK_M=block_m, DOT16=x.dtype in (torch.float16, torch.bfloat16), **common)
    else:
        _gemv_kernel[(triton.cdiv(n, config.block_n), splits)](*args, ROWS=triton.next_power_of_2(rows), **common)
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
