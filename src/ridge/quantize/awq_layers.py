"""AWQ's search over a decoder layer (quant/awq.py states the method): each group of linears sharing an
input gets the scales that minimise the error of the block it feeds, and the scales are folded into the
input's producer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ridge.attention.backend import AttentionBackend
from ridge.models.layers import DecoderLayer, GatedMLP, ResidualAdd
from ridge.quant.awq import ALPHA_GRID, _candidates, awq_scales
from ridge.quant.rtn import dequantize, quantize_int4

if TYPE_CHECKING:  # calibration imports this module
    from ridge.quantize.calibration import LayerInput


SEARCH_WINDOWS = 8  # calibration windows a block-output search runs the block over, 20 times a layer


def check_model(layers: list[DecoderLayer] | torch.nn.ModuleList) -> None:
    """check_layer over a model's layers: before its calibration text is cut, which takes a while."""
    for layer in layers:
        check_layer(layer)


def check_layer(layer: DecoderLayer) -> None:
    """ValueError naming what of the layer AWQ's search does not handle."""
    if layer.parallel:  # its MLP has no input norm to fold the scales into
        raise ValueError("quantization: awq does not support parallel blocks (Cohere) yet; use gptq or int4")
    if isinstance(layer.input_norm, ResidualAdd):  # the scales fold into the norms before qkv and gate|up
        raise ValueError("quantization: awq does not support layers without input norms (OLMo-2's) yet; use gptq "
                         "or int4")
    if not isinstance(layer.mlp, GatedMLP):  # its scales are searched for one dense MLP's gate|up and down
        raise ValueError("quantization: awq does not support mixtures of experts (or layers without an MLP) yet; "
                         "use gptq or int4")


@torch.no_grad()
def scale_layer(layer: DecoderLayer, inputs: list[LayerInput], backend: AttentionBackend, group_size: int,
                integer_zeros: bool) -> None:
    """AWQ's scales for one decoder layer, searched as the reference searches them and folded in place: qkv's
    by the attention block's output, gate|up's by the MLP's output (the error after softmax, SiLU and the
    product, not the linear's own), o_proj's and down's by their own outputs; over the layer's inputs as
    quantize/calibration.py's awq_layerwise, which calls this, carries them."""
    check_layer(layer)
    attn, mlp = layer.attn, layer.mlp
    windows = inputs[:SEARCH_WINDOWS]
    attn_in, attn_ref, mlp_in, mlp_ref = [], [], [], []
    # o_proj's scales go into the v rows: not where a v row feeds several heads' o_proj columns (GQA), nor where
    # the values are normed after their projection, or are the keys (Gemma 4's)
    scale_o_proj = attn.num_heads == attn.num_kv_heads and not attn.gemma4
    inner: dict[str, list[torch.Tensor]] = {"o_proj": [], "down": []}  # those linears' inputs
    hooks = [mlp.down.register_forward_pre_hook(lambda _m, args: inner["down"].append(args[0]))]
    if scale_o_proj:
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda _m, args: inner["o_proj"].append(args[0])))
    try:
        for w in windows:  # the norms add into the residual stream in place: copies
            if w.residual is None:
                residual, x = w.x.clone(), layer.input_norm(w.x)
            else:
                x, residual = layer.input_norm(w.x.clone(), w.residual.clone())
            a = w.attention(layer, x, backend)
            m, _ = layer.post_attn_norm(layer.joining(a.clone(), layer.attn_out_norm), residual)
            attn_in.append(x)
            attn_ref.append(a)
            mlp_in.append(m)
            mlp_ref.append(mlp(m))
    finally:
        for hook in hooks:
            hook.remove()

    def attn_error() -> float:
        return sum(float((w.attention(layer, x, backend) - ref).double().square().sum())
                   for x, w, ref in zip(attn_in, windows, attn_ref, strict=True))

    def mlp_error() -> float:
        return sum(float((mlp(m) - ref).double().square().sum()) for m, ref in zip(mlp_in, mlp_ref, strict=True))

    s = _search_block(attn.qkv.weight, _rms(attn_in), group_size, integer_zeros, attn_error)
    _fold_into_norm(layer.input_norm, s)
    attn.qkv.weight.mul_(s.to(attn.qkv.weight.dtype))
    if scale_o_proj:
        s, _ = awq_scales(attn.o_proj.weight, _gram(inner["o_proj"]), group_size, integer_zeros)
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        v_rows = slice(q_size + kv_size, q_size + 2 * kv_size)
        attn.qkv.weight[v_rows].div_(s[:, None].to(attn.qkv.weight.dtype))
        if attn.qkv.bias is not None:
            attn.qkv.bias[v_rows].div_(s.to(attn.qkv.bias.dtype))
        attn.o_proj.weight.mul_(s.to(attn.o_proj.weight.dtype))
    s = _search_block(mlp.gate_up.weight, _rms(mlp_in), group_size, integer_zeros, mlp_error)
    _fold_into_norm(layer.post_attn_norm, s)
    mlp.gate_up.weight.mul_(s.to(mlp.gate_up.weight.dtype))
    if not mlp.gated:  # down's input is the activation of up itself, which no row scale passes through
        return
    s, _ = awq_scales(mlp.down.weight, _gram(inner["down"]), group_size, integer_zeros)
    mlp.gate_up.weight[mlp.intermediate_size:].div_(s[:, None].to(mlp.gate_up.weight.dtype))
    mlp.down.weight.mul_(s.to(mlp.down.weight.dtype))


def _fold_into_norm(norm: torch.nn.Module, s: torch.Tensor) -> None:
    """The norm's output divided by s, the linears after it taking s into their columns: its weight (and a
    LayerNorm's bias) divided."""
    norm.weight.div_(s.to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(s.to(norm.bias.dtype))


def _gram(xs: list[torch.Tensor]) -> torch.Tensor:
    """X^T X over the rows of xs ([T, K] each)."""
    x = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).float()
    return (x.T @ x).double()


def _rms(xs: list[torch.Tensor]) -> torch.Tensor:
    """Each input channel's RMS over the tokens of xs ([T, K] each): awq_scales' magnitude, from the activations."""
    x = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).double()
    return x.square().mean(0).sqrt().float().clamp(min=1e-4)


def _search_block(weight: torch.Tensor, magnitude: torch.Tensor, group_size: int, integer_zeros: bool,
                  error: Callable[[], float], grid: int = ALPHA_GRID) -> torch.Tensor:
    """awq_scales' search with the error measured by `error()` while `weight` holds Q(W s) / s; the weight is
    left as it was."""
    original = weight.detach().clone()
    w = original.float()
    best_scales, best_error = torch.ones_like(magnitude), float("inf")
    try:
        for scales in _candidates(magnitude, grid):
            weight.copy_(dequantize(quantize_int4(w * scales, group_size, integer_zeros)) / scales)
            e = error()
            if e < best_error:
                best_scales, best_error = scales, e
    finally:
        weight.copy_(original)
    return best_scales
