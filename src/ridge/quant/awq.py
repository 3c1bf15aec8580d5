"""AWQ: activation-aware weight quantization (Lin et al., 2023).

A few input channels carry large activations, and rounding errors in the weight columns they multiply
cost the most. AWQ scales those columns up before rounding (W diag(s)) and the inputs down by the same
factor (x / s), which leaves the product unchanged in full precision but gives the salient columns more
of the 4-bit grid. The division is folded into whatever produces the input, so inference pays nothing:
  qkv     <- input_norm's weight         gate|up <- post_attn_norm's weight
  down    <- the up rows of gate|up      o_proj  <- the v rows of qkv (only without GQA: with it, a v row
                                                    feeds several heads' o_proj columns)
The scales are s = a^alpha, normalised by sqrt(max(s) min(s)), where a is each input channel's activation
magnitude and alpha is searched on a grid per layer (alpha = 0 is plain RTN, so AWQ never does worse than
RTN on the calibration text). Then, as in the paper, each group's range is shrunk by the factor (of a
grid, 1 included) that minimises the error of the group's share of the layer's output: a few large
weights no longer stretch the grid of all the others.

Two deliberate differences from the reference implementation, both so that the X^T X statistics GPTQ
already collects (quant/calibration.py) are all AWQ needs: a is the RMS of each channel (sqrt(H_jj / T))
rather than its mean |x|, and the search minimises each linear layer's own output error
||(W - Q(W s) / s) X||^2 = sum((D H) * D), D = W - Q(W s) / s, rather than a whole block's output.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ridge.models.transformer import DecoderModel
from ridge.quant.rtn import QuantizedWeight, dequantize, int4_codes, int4_grid, quantize_int4

ALPHA_GRID = 20  # alpha in {0, 1/20, ..., 19/20}, as in the paper
CLIP_GRID = 20  # range shrink factors 1, 0.975, ..., 0.525


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
    for step in range(grid):
        scales = magnitude ** (step / grid)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = output_error(w, dequantize(quantize_int4(w * scales, group_size, integer_zeros)) / scales, h)
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales, best_error


def clipped_int4(weight: torch.Tensor, group_size: int, hessian: torch.Tensor, integer_zeros: bool,
                 grid: int = CLIP_GRID) -> QuantizedWeight:
    """int4 RTN per group with each group's range shrunk by the factor that minimises the error of the
    group's share of the output over the calibration tokens, ||(w_g - q_g) X_g||^2 = d_g H_gg d_g^T with
    H_gg the group's diagonal block of H = X^T X: the reference implementation's objective (its partial
    products per group), taken from the statistics; the inputs' correlations inside a group count."""
    n, k = weight.shape
    groups = k // group_size
    w = weight.float().view(n, groups, group_size)
    blocks = hessian.float().view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    best_error = torch.full(w.shape[:2], float("inf"))
    best_scales, best_zeros = int4_grid(weight, group_size, integer_zeros)
    for step in range(grid):
        scales, zeros = int4_grid(weight * (1 - step / (2 * grid)), group_size, integer_zeros)
        q = int4_codes(w, scales, zeros)
        d = (q - zeros[..., None]) * scales[..., None] - w
        error = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scales, best_zeros = torch.where(better, scales, best_scales), torch.where(better, zeros, best_zeros)
    q = int4_codes(w, best_scales, best_zeros).to(torch.uint8)
    return QuantizedWeight(q.view(n, k), best_scales, -best_zeros * best_scales, 4, group_size)


@torch.no_grad()
def apply_awq(model: DecoderModel, hessians: dict[str, torch.Tensor], group_size: int, integer_zeros: bool,
              progress: bool = True) -> None:
    """Scale every decoder layer's linear weights by their AWQ scales and fold the inverse into the
    producers of their inputs (in place; the float model computes the same function up to rounding).
    hessians (keyed as quant/calibration.py keys them) are rescaled to the scaled inputs, in place: what is
    left of AWQ is clipped_int4 of each weight with its hessian."""
    cfg = model.cfg
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(tqdm(model.layers, desc="awq", unit="layer", disable=not progress)):
        attn, mlp = layer.attn, layer.mlp
        s = _scale_columns(attn.qkv.weight, hessians, f"layers.{i}.attn.qkv", group_size, integer_zeros)
        layer.input_norm.weight.div_(s.to(layer.input_norm.weight.dtype))
        if cfg.num_heads == cfg.num_kv_heads:
            s = _scale_columns(attn.o_proj.weight, hessians, f"layers.{i}.attn.o_proj", group_size, integer_zeros)
            v_rows = slice(q_size + kv_size, q_size + 2 * kv_size)
            attn.qkv.weight[v_rows].div_(s[:, None].to(attn.qkv.weight.dtype))
            if attn.qkv.bias is not None:
                attn.qkv.bias[v_rows].div_(s.to(attn.qkv.bias.dtype))
        s = _scale_columns(mlp.gate_up.weight, hessians, f"layers.{i}.mlp.gate_up", group_size, integer_zeros)
        layer.post_attn_norm.weight.div_(s.to(layer.post_attn_norm.weight.dtype))
        s = _scale_columns(mlp.down.weight, hessians, f"layers.{i}.mlp.down", group_size, integer_zeros)
        mlp.gate_up.weight[cfg.intermediate_size:].div_(s[:, None].to(mlp.gate_up.weight.dtype))


def _scale_columns(weight: torch.Tensor, hessians: dict[str, torch.Tensor], key: str, group_size: int,
                   integer_zeros: bool) -> torch.Tensor:
    """Search s for this weight, multiply its columns by it in place and replace its inputs' hessian by
    H / (s s^T); returns s for the caller to fold into the inputs' producer."""
    s, _ = awq_scales(weight, hessians[key], group_size, integer_zeros)
    weight.mul_(s.to(weight.dtype))
    hessians[key] = hessians[key] / (s.double()[:, None] * s.double()[None, :])
    return s
