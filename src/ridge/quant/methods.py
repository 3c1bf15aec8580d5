"""The weight-only quantization methods at load, and the whole model's weights in one of them.

quantize_weights returns every decoder-layer weight, and the vocabulary projection's, in the method's
format; the engine then gives each its layer (linear/select.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from ridge.quant import mxfp4
from ridge.quant.awq import clipped_int4
from ridge.quant.gptq import gptq_quantize
from ridge.quant.rtn import QuantizedWeight, quantize_fp8, quantize_int4, quantize_int8

METHODS = ("int8", "int4", "gptq", "awq", "fp8", "mxfp4")  # quantize_weights' methods
CALIBRATED = ("gptq", "awq")  # methods that need X^T X statistics (quantize/calibration.py)


def quantize_weight(weight: torch.Tensor, method: str, group_size: int,
                    hessian: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """One [out, in] matrix in `method`'s format. awq: the weight and hessian must already carry their AWQ
    scales (quantize/awq_layers.py's scale_layer); what is left is int4 with each group's range clipped. int4 at load
    has float minimums: no checkpoint constrains it (quant/rtn.py). int8 / fp8: `importance`, if given, the
    mean x^2 of each input column, by which each row's scale is chosen (quant/rtn.py)."""
    if method == "int8":
        return quantize_int8(weight, importance)
    if method == "int4":
        return quantize_int4(weight, group_size)
    if method == "awq":
        if hessian is None:
            raise ValueError("quantization: awq needs calibration statistics (quantize/calibration.py)")
        return clipped_int4(weight, group_size, hessian, integer_zeros=False)
    if method == "fp8":
        return quantize_fp8(weight, importance)
    if method == "mxfp4":
        return mxfp4.quantize(weight)
    if method == "gptq":
        if hessian is None:
            raise ValueError("quantization: gptq needs calibration statistics (quantize/calibration.py)")
        return gptq_quantize(weight, hessian, 4, group_size, act_order=True)  # see quant/gptq.py
    raise ValueError(f"quantization: {method!r} is not one of {', '.join(METHODS)}")


# The vocabulary projection's format under every method: int8 per channel. llama.cpp's Q4 files keep it at
# Q6_K / Q8_0 and GPTQ / AWQ / fp8 checkpoints leave it unquantized, for it is the layer whose errors reach
# the logits directly; but on a small model it is a fifth of the weights, too many bytes to leave at 16 bits.
# At one byte a weight, int8 with a scale per row is the more accurate of the two 8-bit formats for it
# (SmolLM2 under fp8: +1.6% perplexity with the head at int8, +2.4% with it at fp8; docs/notes/bench-quantization.md).
HEAD_METHOD = "int8"
HEAD = "output_projection"  # the vocabulary projection's key among the layers' (its input: the final norm's output)


def quantizable(module: nn.Module) -> bool:
    """A linear layer whose weights quantization replaces: any but those marked keep_dense (an MoE router,
    models/moe.py: a few thousand weights whose rounding would move tokens between experts)."""
    return isinstance(module, nn.Linear) and not getattr(module, "keep_dense", False)


def quantize_weights(model: nn.Module, method: str, group_size: int, fitted: dict[str, QuantizedWeight] | None = None,
                     importance: dict[str, torch.Tensor] | None = None,
                     progress: bool = False) -> Iterator[tuple[str, QuantizedWeight]]:
    """(key, weight in `method`'s format), one at a time (the caller swaps each in before the next is made,
    so that the dense weights are freed as it goes), for every nn.Linear of the decoder layers (keys `layers.<i>.<module
    name>`) and the output projection (HEAD, at HEAD_METHOD). gptq and awq need the layers' weights as
    quantize/calibration.py's quantize_layerwise `fitted` them (keyed the same; for awq, the model already holds
    the scales folded in); `importance`, keyed the same way, quantize/calibration.py's input_importance: the int8
    and fp8 weights' rows, and the head's, get the scales it weighs best. The embedding table stays as it is:
    a lookup reads one row per token, not the whole table."""
    if method not in METHODS:
        raise ValueError(f"quantization: {method!r} is not one of {', '.join(METHODS)}")
    if method in CALIBRATED and not fitted:
        raise ValueError(f"quantization: {method} needs calibration (quantize/calibration.py)")
    fitted, importance = fitted or {}, importance or {}
    yield HEAD, quantize_weight(model.output_weight.data, HEAD_METHOD, group_size, importance=importance.get(HEAD))
    for i, layer in enumerate(tqdm(model.layers, desc=method, unit="layer", disable=not progress)):
        linears = [(name, child) for name, child in layer.named_modules() if quantizable(child)]
        for name, child in linears:
            key = f"layers.{i}.{name}"
            yield key, fitted[key] if key in fitted else quantize_weight(child.weight.data, method, group_size,
                                                                         importance=importance.get(key))
