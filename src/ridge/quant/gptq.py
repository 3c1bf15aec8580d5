"""GPTQ: quantize a weight matrix column by column, pushing each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss (Frantar et al., 2022).

The loss is ||(W - Q) X||^2 over calibration inputs X (rows are tokens), whose Hessian in W is
H = 2 X^T X: only H enters, so calibration keeps one [K, K] matrix per linear layer, never the
activations. Per column j of the remaining block, with U the upper Cholesky factor of H^-1:
  err = (w_j - q(w_j)) / U[j, j];   w_{j+1:} -= err * U[j, j+1:]
Columns go in blocks of `block_size` ("lazy batch updates"): inside a block the updates touch only the
block, and the rest of the matrix takes one matmul per block, which keeps the work matmul-shaped.

Formats are those of RTN (quant/rtn.py), so the same kernels run the result: int8 symmetric per output
channel, fp8 e4m3 per output channel, int4 asymmetric per group of input columns, with a float minimum or
(integer_zeros, for a checkpoint's qzeros) an integer zero point. A group's grid is fitted when the sweep
reaches its first column, to the weights as the updates so far have left them, as the reference
implementation does. With act-order (columns taken by decreasing H[j, j], the most sensitive first) the
grids come from the weights before any update ("static groups"), so that a group is still a run of
adjacent columns and g_idx stays column // group_size. ridge runs act-order: on SmolLM2's layers its
output error on held-out text was 1-40% below the plain order's. The layers are taken in order, each on
the inputs that the quantized layers before it produce (quantize/calibration.py's quantize_layerwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ridge.quant.rtn import (
    QuantizedWeight,
    check_group_size,
    int4_grid,
    nearest_fp8,
    nearest_int8,
    quantize_fp8,
    quantize_int8,
)

# Dampening: this fraction of the mean of H's diagonal is added to it before the inverse. The larger, the
# less GPTQ trusts the calibration's input correlations (1/damp -> 0: plain RTN). Integer codes take the
# reference's 0.01. e4m3 codes take 0.1: on SmolLM2 0.01 gave +1.3% / +0.2% perplexity on held-out
# Shakespeare / ShareGPT against 0.1's +0.6% / +0.3% (docs/notes/bench-quantization.md): where rounding errors are
# relative to each weight, pushing them onto small weights costs those weights more than it does on a
# uniform integer grid.
DAMP = 0.01
FP8_DAMP = 0.1


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int | None,
                  act_order: bool = False, block_size: int = 128, damp: float | None = None,
                  integer_zeros: bool = False, fp8: bool = False) -> QuantizedWeight:
    """weight [N, K], hessian [K, K] (X^T X summed over calibration tokens; any positive factor) ->
    codes, scales and minimums. bits 8: per channel (group_size None), int8 or (fp8) e4m3 codes; bits 4:
    per group, on quant/rtn.py's int4_grid(integer_zeros). damp: None for the format's default above."""
    if bits not in (4, 8):
        raise ValueError(f"bits: {bits} is not one of 4, 8")
    if fp8 and bits != 8:
        raise ValueError(f"bits: fp8 codes are 8 bits, not {bits}")
    w = weight.detach().float().clone()
    n, k = w.shape
    if bits == 4:
        if group_size is None:
            raise ValueError("group_size: int4 needs one (32, 64 or 128)")
        check_group_size(k, group_size)
    scales, zeros, round_codes = _grid(w, bits, group_size, integer_zeros, fp8)  # act-order's static grids
    upper, order = _inverse_factor(hessian, w, act_order, FP8_DAMP if fp8 else DAMP if damp is None else damp)
    group_of = order // group_size if group_size else torch.zeros(k, dtype=torch.long)
    w = w[:, order]
    codes = torch.empty(n, k)
    if group_size:
        block_size = max(block_size // group_size, 1) * group_size  # a group starts and ends in one block
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        u = upper[start:end, start:end]
        for j in range(end - start):
            col = start + j
            g = group_of[col]
            if group_size and not act_order and col % group_size == 0:
                grid = int4_grid(block[:, j:j + group_size], group_size, integer_zeros)
                scales[:, g], zeros[:, g] = (t[:, 0] for t in grid)
            s, z = (scales[:, g], zeros[:, g]) if group_size else (scales, zeros)
            q = round_codes(block[:, j] / s + z)
            codes[:, col] = q
            err = (block[:, j] - (q - z) * s) / u[j, j]
            block[:, j:] -= err[:, None] * u[j, j:][None, :]
            errors[:, j] = err
        w[:, end:] -= errors @ upper[start:end, end:]
    codes = codes[:, torch.argsort(order)]
    if fp8:
        return QuantizedWeight(codes.to(torch.float8_e4m3fn), scales, None, 8, None)
    if bits == 8:
        return QuantizedWeight(codes.to(torch.int8), scales, None, 8, None)
    return QuantizedWeight(codes.to(torch.uint8), scales, -zeros * scales, 4, group_size)


def _inverse_factor(hessian: torch.Tensor, w: torch.Tensor, act_order: bool,
                    damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The upper Cholesky factor of the damped inverse Hessian, in the column order GPTQ visits (largest
    diagonal first under act_order), and that order. Columns whose input never fired are zeroed in w."""
    k = w.shape[1]
    h = hessian.detach().double().clone()
    if h.shape != (k, k):
        raise ValueError(f"hessian: shape {tuple(h.shape)} does not match the weight's {k} input columns")
    dead = h.diagonal() == 0  # inputs that never fired: nothing to preserve, the column is free
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k)
    h = h[order][:, order]
    if not damp >= 0:
        raise ValueError(f"damp: must be a fraction >= 0 of the Hessian's mean diagonal, got {damp}")
    h.diagonal().add_(damp * h.diagonal().mean())  # also keeps the factorization well conditioned
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float(), order


def _grid(w: torch.Tensor, bits: int, group_size: int | None, integer_zeros: bool,
          fp8: bool) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Per channel (int8 and fp8, symmetric: zero 0) or per group (int4, RTN's grid): (scales, zero points,
    a function from a column's weights / scale + zero to its codes, as float32)."""
    if fp8:
        return quantize_fp8(w).scales, torch.zeros(w.shape[0]), nearest_fp8
    if bits == 8:
        scales = quantize_int8(w).scales
        return scales, torch.zeros_like(scales), nearest_int8
    return *int4_grid(w, group_size, integer_zeros), lambda u: torch.round(u).clamp(0, 15)

