"""GGUF block formats as integer codes with per-group scales: w = code * scale + minimum.

Every format the four pullable models use is, block by block, an affine map of small integers, so each
tensor unpacks without loss into a QuantizedWeight (codes [N, K], scales and minimums [N, K / group]):

  format  group  codes                 scale            minimum
  Q4_0    32     0..15                 d                -8 d
  Q4_1    32     0..15                 d                m
  Q4_K    32     0..15                 d * sc (6-bit)   -dmin * m (6-bit)
  Q5_0    32     -16..15               d                -
  Q5_1    32     0..31                 d                m
  Q5_K    32     0..31                 d * sc           -dmin * m
  Q6_K    16     -32..31               d * sc (int8)    -
  Q8_0    32     -128..127             d                -

The 4-bit ones then run on torch's int4 kernel (same group, same affine map); the others on ridge's
grouped int8 kernel (kernels/quant_linear.cpp). The bit-unpacking of codes is gguf's own (its
dequantize); only the scale fields are read here, and codes are recovered as (w - minimum) / scale,
which is exact: |w - minimum| / scale <= 127 and float32 carries 24 bits.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize

from ridge.quant.rtn import QuantizedWeight


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per 32-value sub-block (8 of them per 256), scale d * sc and minimum -dmin * m."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return d[:, None] * sc.astype(np.float32), -dmin[:, None] * m.astype(np.float32)


def _scales(kind: GGMLQuantizationType, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales and minimums (None: zero) per group, [n_blocks, groups per block]."""
    q = GGMLQuantizationType
    if kind in (q.Q4_0, q.Q5_0, q.Q8_0):
        d = _f16(blocks, 0)[:, None]
        # Q4_0's codes are unsigned nibbles (0..15) for the int4 kernel; Q5_0's and Q8_0's signed, in int8
        return d, (-8 * d if kind == q.Q4_0 else None)
    if kind in (q.Q4_1, q.Q5_1):
        return _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
    if kind in (q.Q4_K, q.Q5_K):
        return _k_scales(blocks)
    if kind == q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return _f16(blocks, 208)[:, None] * sc, None
    raise AssertionError(kind)


GROUP_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q5_0": 32, "Q5_1": 32, "Q5_K": 32, "Q6_K": 16, "Q8_0": 32}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}
SUPPORTED = tuple(GROUP_SIZES)


def unpack(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int], name: str = "") -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) -> its codes, scales and minimums."""
    if kind.name not in GROUP_SIZES:
        raise ValueError(f"{name}: GGUF type {kind.name} has no native kernel in ridge (supported: "
                         f"{', '.join(SUPPORTED)}); load without --quantization gguf to dequantize it")
    n, k = shape
    group = GROUP_SIZES[kind.name]
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    scales, minimums = _scales(kind, blocks)
    # by rows, not blocks: gguf dequantizes in slices of rows, and a block per row made 20x more slices
    values = dequantize(blocks.reshape(n, -1), kind).reshape(-1, block_values // group, group)
    shifted = values if minimums is None else values - minimums[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scales[..., None] != 0, np.rint(shifted / scales[..., None]), 0)
    groups = (n, k // group)
    return QuantizedWeight(
        torch.from_numpy(codes.reshape(n, k).astype(np.uint8 if BITS[kind.name] == 4 else np.int8)),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(groups))),
        None if minimums is None else torch.from_numpy(np.ascontiguousarray(minimums.reshape(groups))),
        BITS[kind.name], group,
    )
