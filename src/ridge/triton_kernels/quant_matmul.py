"""Triton matmuls of activations by a weight-only quantized matrix, for the CUDA path (linear/triton.py).

y[M, N] = x[M, K] @ W.T with W[n, k] = code[n, k] * scale + minimum, scale and minimum per output channel
or per group of input columns: ridge's int8 (per channel), int4 / GPTQ / AWQ (4-bit per group, as nibbles)
and fp8 (e4m3 per channel) on one pair of kernels. The codes are dequantized in registers, tile by tile, so
a decode step reads the quantized bytes and nothing else: the reason to quantize on a bandwidth-bound GPU.

Codes are stored as
  - "nibbles": 4-bit codes two per byte, column j holding k = j (low nibble) and k = j + K/2 (high): each
    tile multiplies two halves of x, with no interleaving of nibbles in registers;
  - "bytes": one int8 / uint8 code per weight;
  - "fp8": e4m3 codes as bytes, widened to float16 by moving their bits (the exponent bias differs by 8:
    one multiply by 2^8 puts it right), which needs no fp8 support from the GPU or the interpreter.

A tile is [BLOCK_N rows, GROUPS groups, GROUP columns] of codes, so that each group's scale and minimum are
loaded once, as a [BLOCK_N, GROUPS] block, and broadcast over the group's columns rather than gathered per
weight (docs/notes/gpu.md). Per-channel formats have one "group" of 128 columns per tile and their
scale is applied to the output.

Two kernels: at up to GEMV_MAX_ROWS rows (decode) a GEMV that multiplies and sums along K in registers,
a row at a time, with K split over several programs (partial sums added after) so that every multiprocessor
streams weights; above, a tiled tl.dot on TF32 tensor cores (IEEE float32 for float32 models; a dequantized
weight is exact in float32, and the interpreter that checks these kernels on the CPU has no bfloat16 dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NIBBLES, BYTES, FP8 = 0, 1, 2
GEMV_MAX_ROWS = 8
TILE_COLUMNS = 128  # code columns per tile


@triton.jit
def _dequantize(codes, n, group, scales_ptr, mins_ptr, stride_sn, N,
                GROUP: tl.constexpr, KIND: tl.constexpr, HAS_MIN: tl.constexpr):
    """float32 weights of a [BLOCK_N, GROUPS, COLUMNS] tile of codes at rows n, of groups `group` ([GROUPS] group
    indices; per-channel scales (GROUP 0) are left to the caller)."""
    if KIND == 2:
        bits = ((codes & 0x80).to(tl.int16) << 8) | ((codes & 0x7F).to(tl.int16) << 7)
        w = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        w = codes.to(tl.float32)
    if GROUP > 0:
        where = n[:, None] * stride_sn + group[None, :]
        mask = (n < N)[:, None]
        w = w * tl.load(scales_ptr + where, mask=mask, other=0.0).to(tl.float32)[:, :, None]
        if HAS_MIN:
            w = w + tl.load(mins_ptr + where, mask=mask, other=0.0).to(tl.float32)[:, :, None]
    return w


@triton.jit
def _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn, stride_sn, N,
          GROUP: tl.constexpr, KIND: tl.constexpr, HAS_MIN: tl.constexpr, GROUPS: tl.constexpr,
          COLUMNS: tl.constexpr):
    """The float32 weights of the tile of code columns [start, start + GROUPS * COLUMNS), 3-D, and their
    columns: (low weights, high weights or None, columns [GROUPS, COLUMNS], in-range mask of them)."""
    g = tl.arange(0, GROUPS)
    e = tl.arange(0, COLUMNS)
    j = start + g[:, None] * COLUMNS + e[None, :]  # [GROUPS, COLUMNS]
    j_in = j < last
    codes = tl.load(codes_ptr + n[:, None, None] * stride_cn + j[None, :, :],
                    mask=(n < N)[:, None, None] & j_in[None, :, :], other=0)
    group = start // COLUMNS + g  # with GROUP > 0, COLUMNS == GROUP
    if KIND == 0:
        low = _dequantize(codes & 0xF, n, group, scales_ptr, mins_ptr, stride_sn, N, GROUP, KIND, HAS_MIN)
        high = _dequantize(codes >> 4, n, group + code_columns // COLUMNS, scales_ptr, mins_ptr, stride_sn, N,
                           GROUP, KIND, HAS_MIN)
        return tl.where(j_in[None, :, :], low, 0.0), tl.where(j_in[None, :, :], high, 0.0), j, j_in
    w = _dequantize(codes, n, group, scales_ptr, mins_ptr, stride_sn, N, GROUP, KIND, HAS_MIN)
    return tl.where(j_in[None, :, :], w, 0.0), w, j, j_in


@triton.jit
def _gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, code_columns, columns_per_split,
    stride_xm, stride_cn, stride_sn, stride_os, stride_om,
    GROUP: tl.constexpr, KIND: tl.constexpr, HAS_MIN: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, COLUMNS: tl.constexpr,
):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    first = split * columns_per_split
    last = tl.minimum(first + columns_per_split, code_columns)
    for start in range(first, last, GROUPS * COLUMNS):
        w, high, j, j_in = _tile(codes_ptr, scales_ptr, mins_ptr, n, start, last, code_columns, stride_cn,
                                 stride_sn, N, GROUP, KIND, HAS_MIN, GROUPS, COLUMNS)
        for m in tl.static_range(ROWS):
            x_mask = j_in & (m < M)
            x = tl.load(x_ptr + m * stride_xm + j, mask=x_mask, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(w * x[None, :, :], 2), 1)
            if KIND == 0:
                x_high = tl.load(x_ptr + m * stride_xm + j + code_columns, mask=x_mask, other=0.0).to(tl.float32)
                part += tl.sum(tl.sum(high * x_high[None, :, :], 2), 1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if GROUP == 0:
        acc = acc * tl.load(scales_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (n < N)[None, :])


@triton.jit
def _matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, code_columns,
    stride_xm, stride_cn, stride_sn, stride_om,
    GROUP: tl.constexpr, KIND: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, COLUMNS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, code_columns, GROUPS * COLUMNS):
        w, high, j, j_in = _tile(codes_ptr, scales_ptr, mins_ptr, n, start, code_columns, code_columns, stride_cn,
                                 stride_sn, N, GROUP, KIND, HAS_MIN, GROUPS, COLUMNS)
        flat = tl.reshape(j, [GROUPS * COLUMNS])
        x_mask = (m < M)[:, None] & tl.reshape(j_in, [GROUPS * COLUMNS])[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + flat[None, :], mask=x_mask, other=0.0).to(tl.float32)
        acc += tl.dot(x, tl.trans(tl.reshape(w, [BLOCK_N, GROUPS * COLUMNS])), input_precision=PRECISION)
        if KIND == 0:
            x_high = tl.load(x_ptr + m[:, None] * stride_xm + flat[None, :] + code_columns, mask=x_mask,
                             other=0.0).to(tl.float32)
            acc += tl.dot(x_high, tl.trans(tl.reshape(high, [BLOCK_N, GROUPS * COLUMNS])), input_precision=PRECISION)
    if GROUP == 0:
        acc = acc * tl.load(scales_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 in 0..15, K even) -> [N, K / 2] bytes: k = j low, k = j + K/2 high."""
    half = codes.shape[1] // 2
    return (codes[:, :half] | (codes[:, half:] << 4)).to(torch.uint8).contiguous()


def fits(kind: int, in_features: int, group_size: int) -> bool:
    """Whether the kernels take this layout: a nibble's two halves must start groups of their own."""
    return kind != NIBBLES or (in_features % 2 == 0 and (in_features // 2) % max(group_size, 1) == 0)


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, kind: int, scales: torch.Tensor,
                 minimums: torch.Tensor | None, group_size: int, out_features: int,
                 multiprocessors: int) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, out_features] in x's dtype. codes as `kind` stores them; scales (and
    minimums) [N] with group_size 0, else [N, K / group_size] (float16 or float32)."""
    rows = x.shape[0]
    columns = codes.shape[1]
    group_columns = group_size if group_size else TILE_COLUMNS
    groups = max(1, TILE_COLUMNS // group_columns)
    tile = groups * group_columns
    common = dict(GROUP=group_size, KIND=kind, HAS_MIN=minimums is not None, GROUPS=groups, COLUMNS=group_columns)
    mins = minimums if minimums is not None else scales
    scale_stride = scales.stride(0) if scales.dim() == 2 else 0
    if rows <= GEMV_MAX_ROWS:
        block_n = 32
        tiles = triton.cdiv(out_features, block_n)
        wanted = -(-4 * multiprocessors // tiles)  # about four programs per multiprocessor
        splits = max(1, min(wanted, columns // (2 * tile)))
        per_split = triton.cdiv(triton.cdiv(columns, splits), tile) * tile
        splits = triton.cdiv(columns, per_split)
        out = torch.empty(splits, rows, out_features, dtype=torch.float32 if splits > 1 else x.dtype,
                          device=x.device)
        _gemv_kernel[(tiles, splits)](
            x, codes, scales, mins, out, rows, out_features, columns, per_split,
            x.stride(0), codes.stride(0), scale_stride, out.stride(0), out.stride(1),
            ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, num_warps=4, **common,
        )
        return out[0] if splits == 1 else out.sum(0).to(x.dtype)
    block_m = 32 if rows <= 32 else 64
    block_n = 64
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    _matmul_kernel[(triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))](
        x, codes, scales, mins, out, rows, out_features, columns,
        x.stride(0), codes.stride(0), scale_stride, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common,
    )
    return out
