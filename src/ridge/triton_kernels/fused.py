"""Fused element-wise kernels of the CUDA path, in Triton: the residual add with RMSNorm, rotary embedding,
and SiLU(gate) * up. The same three functions, with the same signatures, as ridge's CPU kernels
(kernels/cpu_ops.py, whose C++ the CPU path calls), so the model's layers take either module as their `ops`.

A decode step runs a few hundred kernels, most of them element-wise, each costing a few microseconds whatever
its size (docs/notes/gpu.md measures their share). Each function here is one kernel where torch runs two to four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(residual_ptr, x_ptr, weight_ptr, out_ptr, stride_r, stride_x, stride_o, dim, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    inside = i < dim
    total = (tl.load(residual_ptr + row * stride_r + i, mask=inside, other=0.0).to(tl.float32)
             + tl.load(x_ptr + row * stride_x + i, mask=inside, other=0.0).to(tl.float32))
    total = total.to(residual_ptr.dtype.element_ty)  # the residual stream keeps its dtype, as `residual += x`
    tl.store(residual_ptr + row * stride_r + i, total, mask=inside)
    total = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(total * total, 0) / dim + eps)
    weight = tl.load(weight_ptr + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (total * scale * weight).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, table_ptr, stride_t, stride_h, heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_D)
    cos = tl.load(table_ptr + position * 2 * HALF + 2 * i, mask=i < HALF, other=1.0)
    sin = tl.load(table_ptr + position * 2 * HALF + 2 * i + 1, mask=i < HALF, other=0.0)
    mask = (h < heads)[:, None] & (i < HALF)[None, :]
    first = x_ptr + token * stride_t + h[:, None] * stride_h + i[None, :]
    real = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    imag = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (real * cos[None, :] - imag * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (imag * cos[None, :] + real * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < width
    gate = tl.load(gate_up_ptr + row * stride_g + i, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + width + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); return rms_norm(residual) * weight. Rows [T, dim], contiguous."""
    rows, dim = residual.shape
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(rows,)](residual, x, weight, out, residual.stride(0), x.stride(0), out.stride(0), dim, eps,
                                  BLOCK=triton.next_power_of_2(dim))
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, heads: int) -> None:
    """Rotate heads [0, heads) of x [T, all_heads, head_dim] in place (rotate-half form: the first half of a head
    is the real part); table: float32 [max_positions, head_dim / 2, 2] of (cos, sin)."""
    tokens, _, head_dim = x.shape
    if tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(tokens,)](x, positions, table, x.stride(0), x.stride(1), heads, HALF=half,
                              BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up, [T, I]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                        BLOCK=block)
    return out
