"""AWQ: activation-aware weight quantization (Lin et al., 2023).

A few input channels carry large activations, and rounding errors in the weight columns they multiply
cost the most. AWQ scales those columns up before rounding (W diag(s)) and the inputs down by the same
factor (x / s), which leaves the product unchanged in full precision but gives the salient columns more
of the 4-bit grid. The division is folded into whatever produces the input, so inference pays nothing:
  qkv     <- input_norm's weight         gate|up <- post_attn_norm's weight
  down    <- the up rows of gate|up      o_proj  <- the v rows of qkv (only without GQA: with it, a v row
                                                    feeds several heads' o_proj columns)
The scales are s = a^alpha, normalised by sqrt(max(s) min(s)), where a is each input channel's RMS over
the calibration tokens and alpha is searched on a grid for each group of linears sharing an input (alpha = 0
is plain RTN). As in the reference, a group is judged by the output of the block it feeds: qkv by the
attention's output, gate|up by the MLP's (the errors after softmax, SiLU and the product, not the linears'
own), o_proj and down by their own, ||(W - Q(W s) / s) X||^2 = sum((D H) * D) from H = X^T X. As in AutoAWQ,
the layers are walked in order, each searched on the full-precision model's activations (quantize/awq_layers.py,
called by quantize/calibration.py's awq_layerwise). Then, as in the paper, each group's range is shrunk by the
factor (of a grid, 1 included) that minimises the error of the group's share of the layer's output: a few
large weights no longer stretch the grid of all the others.

Two differences from the reference (docs/notes/bench-quantization.md has both measured on Qwen2.5-Coder-0.5B):
- a is the RMS of each channel, not its mean |x| (the mean was no better);
- after the shrink, each group's grid is fitted to its codes under the same objective (clipped_int4's
  refits): the shrink moves both ends of the range together, the fit moves each on its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ridge.quant.rtn import QuantizedWeight, dequantize, int4_codes, int4_grid, quantize_int4, storable_scale

ALPHA_GRID = 20  # alpha in {0, 1/20, ..., 19/20}, as in the paper
CLIP_GRID = 20  # range shrink factors 1, 0.975, ..., 0.525
REFITS = 8  # rounds of fitting each group's grid to its codes after the shrink (on Qwen2.5-Coder-0.5B's
#             weights 8 took the error 1% below 4, 16 no lower)


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """||(W - approx) X||^2 over the calibration tokens, from H = X^T X. The product in float32 (twice
    float64's speed; what the searches compare differs in the third digit, float32's error is in the
    seventh), the sum in float64."""
    diff = (weight - approx).float()
    return float(((diff @ hessian.float()) * diff).sum(dtype=torch.float64))


def awq_scales(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, integer_zeros: bool,
               grid: int = ALPHA_GRID) -> tuple[torch.Tensor, float]:
    """The per-input-channel scales s [K] that minimise the layer's output error after int4 RTN of W diag(s),
    and that error."""
    w, h = weight.float(), hessian.float()
    magnitude = h.diagonal().clamp(min=0).sqrt().clamp(min=1e-4)  # RMS up to the common 1/sqrt(T)
    best_scales, best_error = torch.ones_like(magnitude), float("inf")
    for scales in _candidates(magnitude, grid):
        error = output_error(w, dequantize(quantize_int4(w * scales, group_size, integer_zeros)) / scales, h)
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales, best_error


def clipped_int4(weight: torch.Tensor, group_size: int, hessian: torch.Tensor, integer_zeros: bool,
                 grid: int = CLIP_GRID, refits: int = REFITS) -> QuantizedWeight:
    """int4 per group with each group's range chosen to minimise the error of the group's share of the output
    over the calibration tokens, ||(w_g - q_g) X_g||^2 = d_g H_gg d_g^T with H_gg the group's diagonal block of
    H = X^T X: the reference implementation's objective (its partial products per group), taken from the
    statistics; the inputs' correlations inside a group count. Two stages, each kept per group only where it
    lowers that error: the reference's search, the range shrunk by each factor of a grid; then `refits`
    rounds of fitting the grid to the codes (scale and minimum by least squares under H_gg, codes rounded
    again), which moves each end of the range on its own where the shrink moves both (on Qwen2.5-Coder-0.5B,
    whose weights come from 5- and 6-bit blocks, it takes the plain squared error 10% below the best shrink's;
    docs/notes/bench-quantization.md)."""
    n, k = weight.shape
    groups = k // group_size
    w = weight.float().view(n, groups, group_size)
    blocks = hessian.float().view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    best_error = torch.full(w.shape[:2], float("inf"))
    best_scales, best_zeros = int4_grid(weight, group_size, integer_zeros)

    def keep_better(scales: torch.Tensor, zeros: torch.Tensor) -> None:
        nonlocal best_error, best_scales, best_zeros
        d = (int4_codes(w, scales, zeros) - zeros[..., None]) * scales[..., None] - w
        error = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scales, best_zeros = torch.where(better, scales, best_scales), torch.where(better, zeros, best_zeros)

    for step in range(grid):
        keep_better(*int4_grid(weight * (1 - step / (2 * grid)), group_size, integer_zeros))
    for _ in range(refits):
        keep_better(*_fit_grid(w, blocks, int4_codes(w, best_scales, best_zeros), best_scales, best_zeros,
                               integer_zeros))
    q = int4_codes(w, best_scales, best_zeros).to(torch.uint8)
    return QuantizedWeight(q.view(n, k), best_scales, -best_zeros * best_scales, 4, group_size)


def _fit_grid(w: torch.Tensor, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              integer_zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scales, zeros) [N, groups] whose levels best fit w [N, groups, G] at the given codes, under each
    group's H_gg (blocks [groups, G, G]): w ~ codes * scale + minimum by weighted least squares, a 2 x 2 system
    a group; with integer zeros the zero point stays and the scale alone is fitted. Where a system is singular
    (a group of silent inputs) or gives no positive scale, the group keeps its grid."""
    h_one = blocks.sum(-1)  # H 1 [groups, G]
    h_codes = torch.einsum("gij,ngj->ngi", blocks, codes)  # H q
    if integer_zeros:
        centred = codes - zeros[..., None]
        h_centred = h_codes - zeros[..., None] * h_one
        raw = (h_centred * w).sum(-1) / (h_centred * centred).sum(-1)
        return torch.where(raw.isfinite() & (raw > 0), storable_scale(raw), scales), zeros
    qhq, qh1, one_h_one = (h_codes * codes).sum(-1), h_codes.sum(-1), h_one.sum(-1)
    qhw, one_hw = (h_codes * w).sum(-1), torch.einsum("gi,ngi->ng", h_one, w)
    det = qhq * one_h_one - qh1 * qh1
    raw = (one_h_one * qhw - qh1 * one_hw) / det
    fitted = storable_scale(raw)  # judged before this, which would lift a negative fit to float16's least
    minimums = (one_hw - fitted * qh1) / one_h_one  # the best minimum for the scale as stored (float16)
    ok = (det > 1e-6 * qhq * one_h_one) & raw.isfinite() & (raw > 0) & minimums.isfinite()
    return torch.where(ok, fitted, scales), torch.where(ok, -minimums / fitted, zeros)


def _candidates(magnitude: torch.Tensor, grid: int) -> Iterator[torch.Tensor]:
    """s = a^alpha for alpha in {0, 1/grid, ...}, each normalised by sqrt(max(s) min(s))."""
    for step in range(grid):
        scales = magnitude ** (step / grid)
        yield scales / (scales.max() * scales.min()).sqrt()
