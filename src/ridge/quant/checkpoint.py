"""Quantized checkpoints in the layouts the ecosystem writes and reads: GPTQ, AWQ and fp8, both ways.

GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"; vLLM, SGLang and TGI read it). A linear layer
[out N, in K] at b bits, 32 / b codes per int32, the lowest bits first:
  qweight  int32   [K b / 32, N]   codes, packed along the input dimension
  qzeros   int32   [G, N b / 32]   zero point - 1 (the format's historical off-by-one), packed along the output
  scales   float16 [G, N]
  g_idx    int32   [K]             each input column's group
  w[n, k] = scales[g, n] * (code[n, k] - zero[g, n]),  g = g_idx[k]
AWQ (AutoAWQ's "gemm" version), 4 bits:
  qweight  int32   [K, N / 8]      codes, packed along the output dimension, in the column order 0 2 4 6 1 3 5 7
  qzeros   int32   [G, N / 8]      zero points, packed the same way
  scales   float16 [G, N]
fp8 (HF transformers' "fp8" method, the layout DeepSeek-V3 ships):
  weight            float8_e4m3fn [N, K]
  weight_scale_inv  float32 [N / bn, K / bk]   w = weight * scale, per block of weight_block_size [bn, bk]
  ridge's per-channel scales are written as blocks of [1, FP8_BLOCK_COLUMNS], each row's scale repeated.

Reading maps each layout onto a QuantizedWeight (quant/rtn.py). A layer whose layout no kernel here runs
(act-order g_idx without static groups, 4 bits per channel, fp8 blocks spanning rows) is dequantized and
multiplied as a plain matrix; the loader says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from ridge.quant.rtn import GROUP_SIZES, QuantizedWeight, zero_points

log = logging.getLogger("ridge")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8
FP8_BLOCK_COLUMNS = 16  # divides the input dimension of every model here
T = TypeVar("T")
LAYOUTS = ("gptq", "awq", "fp8")


def _pack(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes [..., M] -> int32 [..., M * bits / 32], code i of each run in bits [bits i, bits (i+1))."""
    per_word = 32 // bits
    runs = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per_word)
    if order is not None:
        runs = runs[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (runs << shifts).sum(dim=-1)
    return (words - (words >> 31 << 32)).to(torch.int32)  # two's complement: the top bit is the sign


def _unpack(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of _pack: int32 [..., W] -> int64 codes [..., W * 32 / bits]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    runs = (words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    if order is not None:
        runs = runs[..., [order.index(i) for i in range(per_word)]]
    return runs.reshape(*words.shape[:-1], -1)


def _unsigned(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] in [0, 2^bits), zero points [G, N], scales [G, N]) of an int4 or int8 weight."""
    if qw.group_size is None:  # int8 symmetric: code = q + 128, zero point 128
        codes = qw.qweight.to(torch.int64) + 128
        return codes, torch.full((1, qw.shape[0]), 128, dtype=torch.int64), qw.scales[None, :]
    return qw.qweight.to(torch.int64), zero_points(qw).T.to(torch.int64), qw.scales.T


def pack_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    k = qw.shape[1]
    codes, zeros, scales = _unsigned(qw)
    return {
        "qweight": _pack(codes, qw.bits).T.contiguous(),
        "qzeros": _pack((zeros - 1) & ((1 << qw.bits) - 1), qw.bits),
        "scales": scales.half().contiguous(),
        "g_idx": (torch.arange(k) // (qw.group_size or k)).to(torch.int32),
    }


def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    if qw.bits != 4 or qw.group_size is None:
        raise ValueError("awq: the AWQ layout holds 4-bit codes per group only")
    codes, zeros, scales = _unsigned(qw)
    return {
        "qweight": _pack(codes.T.contiguous(), 4, AWQ_ORDER),
        "qzeros": _pack(zeros, 4, AWQ_ORDER),
        "scales": scales.half().contiguous(),
    }


def pack_fp8(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    n, k = qw.shape
    return {"weight": qw.qweight.contiguous(),
            "weight_scale_inv": qw.scales.float()[:, None].expand(n, k // FP8_BLOCK_COLUMNS).contiguous()}


def quantization_config(layout: str, bits: int, group_size: int | None, act_order: bool = False) -> dict[str, Any]:
    """config.json's quantization_config for a checkpoint ridge writes."""
    if layout == "gptq":
        return {"quant_method": "gptq", "checkpoint_format": "gptq", "bits": bits, "group_size": group_size or -1,
                "sym": group_size is None, "desc_act": act_order, "static_groups": act_order, "lm_head": False}
    if layout == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size, "zero_point": True}
    if layout == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [1, FP8_BLOCK_COLUMNS]}
    raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")


def layer_parts(config: dict[str, Any]) -> tuple[str, ...]:
    """The tensors one quantized layer of a checkpoint holds, by config.json's quantization_config; a layout or
    bit width no reader here knows is refused by name."""
    method = config.get("quant_method")
    if method not in LAYOUTS:
        raise ValueError(f"quantization_config.quant_method: {method!r} is not one of {', '.join(LAYOUTS)}")
    if method in ("gptq", "awq"):
        bits = int(config.get("bits", 4))
        if bits not in (4, 8) or (method == "awq" and bits != 4):
            supported = "4, 8" if method == "gptq" else "4"
            raise ValueError(f"quantization_config.bits: {bits} is not supported for {method} ({supported})")
        if method == "gptq" and config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: {config['checkpoint_format']!r} is not one of "
                             "gptq, gptq_v2")
    return {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
            "fp8": ("weight", "weight_scale_inv")}[method]


def group_layers(items: Iterable[tuple[str, T]], config: dict[str, Any]) -> Iterator[tuple[str, T | dict[str, T]]]:
    """A checkpoint's tensors (any handle on them: nothing is read here) -> (name, item) for each tensor outside
    the quantized layers, then ("<module>.weight", {part: item}) for each quantized layer. An fp8 checkpoint's
    module with a weight and no weight_scale_inv is one it keeps in floats (norms, embeddings, the head)."""
    parts = layer_parts(config)
    layers: dict[str, dict[str, T]] = {}
    for name, item in items:
        module, _, part = name.rpartition(".")
        if part in parts:
            layers.setdefault(module, {})[part] = item
        else:
            yield name, item
    for module, found in layers.items():
        if found.keys() == {"weight"}:
            yield f"{module}.weight", found["weight"]
        elif len(found) < len(parts):
            raise ValueError(f"{module}: has {sorted(found)} but not all of {list(parts)} (a truncated checkpoint?)")
        else:
            yield f"{module}.weight", found


def layer_shape(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> tuple[int, int]:
    """[out N, in K] of a quantized layer, from its tensors' shapes alone."""
    method, bits = config["quant_method"], int(config.get("bits", 4))
    if method == "gptq":
        packed_k, n = shapes["qweight"]
        return n, packed_k * 32 // bits
    if method == "awq":
        k, packed_n = shapes["qweight"]
        return packed_n * 8, k
    n, k = shapes["weight"]
    return n, k


def read_quantized(tensors: Iterable[tuple[str, torch.Tensor]],
                   config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A checkpoint's tensors -> ("<module>.weight", QuantizedWeight or a dequantized float tensor) per
    quantized layer; every other tensor as it is. config: config.json's quantization_config."""
    for name, item in group_layers(tensors, config):
        yield name, decode_layer(item, config, name.removesuffix(".weight")) if isinstance(item, dict) else item


def decode_layer(t: dict[str, torch.Tensor], config: dict[str, Any], module: str) -> torch.Tensor | QuantizedWeight:
    """One quantized layer's tensors -> a QuantizedWeight a kernel here runs, or else its dequantized matrix."""
    method = config["quant_method"]
    if method == "fp8":
        scales = t["weight_scale_inv"].float()
        if scales.shape[0] == t["weight"].shape[0] and bool((scales == scales[:, :1]).all()):
            return QuantizedWeight(t["weight"], scales[:, 0].contiguous(), None, 8, None)
        return _dense(_fp8_blocks(t["weight"], scales), module, "fp8 blocks that span rows")
    bits = int(config.get("bits", 4))
    if method == "gptq":
        codes = _unpack(t["qweight"].T.contiguous(), bits)  # [N, K]
        zeros = _unpack(t["qzeros"], bits)  # [G, N]
        if config.get("checkpoint_format", "gptq") == "gptq":
            zeros = (zeros + 1) & ((1 << bits) - 1)
        g_idx = t["g_idx"].to(torch.int64)
    else:
        codes = _unpack(t["qweight"], 4, AWQ_ORDER).T.contiguous()
        zeros = _unpack(t["qzeros"], 4, AWQ_ORDER)
        k = codes.shape[1]
        g_idx = torch.arange(k) // (k // t["scales"].shape[0])
    scales = t["scales"].float()  # [G, N]
    n, k = codes.shape
    groups = scales.shape[0]
    group = k // groups
    if groups * group == k and torch.equal(g_idx, torch.arange(k) // group):
        if bits == 8 and groups == 1 and bool((zeros == 128).all()):
            return QuantizedWeight((codes - 128).to(torch.int8), scales[0].contiguous(), None, 8, None)
        if bits == 4 and group in GROUP_SIZES:
            return QuantizedWeight(codes.to(torch.uint8), scales.T.contiguous(), (-zeros * scales).T.contiguous(), 4,
                                   group)
    # any other arrangement: the plain matrix
    w = (codes - zeros[g_idx].T).float() * scales[g_idx].T
    return _dense(w, module, f"{bits}-bit groups of {group} columns" + (" in act-order" if groups * group == k else ""))


def _fp8_blocks(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    rows, cols = -(-n // scales.shape[0]), -(-k // scales.shape[1])
    full = scales.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return weight.float() * full


def _dense(weight: torch.Tensor, module: str, what: str) -> torch.Tensor:
    log.info("%s: %s have no kernel here; multiplying the dequantized matrix", module, what)
    return weight

