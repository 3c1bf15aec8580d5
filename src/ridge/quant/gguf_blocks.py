"""GGUF block formats as integer codes with per-group scales: w = code * scale + minimum.

Every format the four pullable models use is, block by block, an affine map of small integers (MXFP4, gpt-oss's,
of a table's values at small integers), so each tensor unpacks without loss into a QuantizedWeight (codes [N, K],
scales and minimums [N, K / group], the table as its levels):

  format  group  codes                 scale            minimum
  Q4_0    32     -8..7                 d                -
  Q4_1    32     0..15                 d                m
  Q4_K    32     0..15                 d * sc (6-bit)   -dmin * m (6-bit)
  Q5_0    32     -16..15               d                -
  Q5_1    32     0..31                 d                m
  Q5_K    32     0..31                 d * sc           -dmin * m
  Q6_K    16     -32..31               d * sc (int8)    -
  Q8_0    32     -128..127             d                -
  MXFP4   32     0..15: an index into  2^(e - 128)      -    (quant/mxfp4.py)
                 -12..12 (doubled e2m1)

The 4-bit ones then run on torch's int4 kernel (same group, same affine map; Q4_0's codes shifted to 0..15 with a
minimum of -8 d); the others, and MXFP4 (its 4-bit codes looked up in registers), on ridge's grouped int8 kernel
(kernels/quant_linear.cpp).

The codes' bits are unpacked here, in torch, rather than by gguf's numpy dequantize, which was most of a model's
load; dequantize() does it in one C++ pass where ridge's kernels built (kernels/gguf_blocks.cpp: each torch op
here first-touched a fresh tensor; figures: docs/notes/server-hardening.md). Both compute gguf's own products in
the same order (scale times code, then plus the minimum), so the values are gguf's to the bit; formats not in the
table still go through gguf.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize

from ridge.quant import mxfp4
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
        return _f16(blocks, 0)[:, None], None
    if kind in (q.Q4_1, q.Q5_1):
        return _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
    if kind in (q.Q4_K, q.Q5_K):
        return _k_scales(blocks)
    if kind == q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return _f16(blocks, 208)[:, None] * sc, None
    if kind == q.MXFP4:  # e, then the nibbles
        return mxfp4.scales(torch.from_numpy(blocks[:, :1].copy())).numpy(), None
    raise AssertionError(kind)


def _nibbles(packed: torch.Tensor, run: int) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes]: for each run of `run` bytes, their low nibbles, then their high ones."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, run)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(n, -1)


def _bits(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[n, bytes] -> [n, len(shifts) * bytes]: the field at each shift of every byte, a shift's bytes together."""
    n = packed.shape[0]
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(1, -1, 1)
    return ((packed.reshape(n, 1, -1) >> by) & mask).reshape(n, -1)


def _codes(kind: GGMLQuantizationType, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' codes (int8 [n_blocks, values per block]) in the table's convention."""
    q = GGMLQuantizationType
    if kind == q.Q8_0:
        return blocks[:, 2:].view(torch.int8)
    if kind in (q.Q4_0, q.Q4_1):
        codes = _nibbles(blocks[:, 2 if kind == q.Q4_0 else 4:], 16).view(torch.int8)
        return codes - 8 if kind == q.Q4_0 else codes
    if kind in (q.Q5_0, q.Q5_1):  # qh: a little-endian uint32, bit i the fifth bit of value i
        start = 2 if kind == q.Q5_0 else 4
        high = _bits(blocks[:, start:start + 4], list(range(8)), 1)  # [n, 8 shifts * 4 bytes]
        high = high.reshape(-1, 8, 4).transpose(1, 2).reshape(-1, 32)  # value 8 * byte + shift
        codes = (_nibbles(blocks[:, start + 4:], 16) | (high << 4)).view(torch.int8)
        return codes - 16 if kind == q.Q5_0 else codes
    if kind == q.Q4_K:
        return _nibbles(blocks[:, 16:], 32).view(torch.int8)
    if kind == q.Q5_K:  # qh[32]: bit s of byte j the fifth bit of value j of sub-block s
        return (_nibbles(blocks[:, 48:], 32) | (_bits(blocks[:, 16:48], list(range(8)), 1) << 4)).view(torch.int8)
    if kind == q.Q6_K:  # ql[128] in two halves of 64, qh[64] in two halves of 32 with four 2-bit fields a byte
        low = _nibbles(blocks[:, :128], 64)
        high = torch.cat([_bits(blocks[:, 128 + 32 * h:160 + 32 * h], [0, 2, 4, 6], 3) for h in range(2)], dim=1)
        return (low | (high << 4)).view(torch.int8) - 32
    if kind == q.MXFP4:  # indices into mxfp4.LEVELS
        return _nibbles(blocks[:, 1:], 16).view(torch.int8)
    raise AssertionError(kind)


def _blocks(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[kind][1])


def _read_only(blocks: np.ndarray) -> torch.Tensor:
    """The blocks as a tensor without a copy. The file's map is read-only, which torch warns of: nothing here
    writes to it (every code is computed into a new tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(blocks)


def dequantize(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...],
               ops: ModuleType | None = None) -> np.ndarray:
    """A GGUF tensor's raw data -> its float32 values in `shape`: gguf's dequantize, to the bit. ops: ridge's CPU
    kernels, which unpack and scale in one pass (kernels/gguf_blocks.cpp); without them, torch ops."""
    if kind.name not in GROUP_SIZES:
        return gguf_dequantize(data, kind).reshape(shape)
    blocks = _blocks(data, kind)
    scales, minimums = _scales(kind, blocks)
    if ops is not None and kind.name not in LEVELS:  # kernels/gguf_blocks.cpp unpacks the affine formats
        out = torch.empty(int(np.prod(shape)), dtype=torch.float32)
        ops.gguf_dequantize_(out, _read_only(blocks), int(kind), torch.from_numpy(np.ascontiguousarray(scales)),
                             None if minimums is None else torch.from_numpy(np.ascontiguousarray(minimums)))
        return out.numpy().reshape(shape)
    groups = scales.shape[1]
    codes = _codes(kind, _read_only(blocks))
    if kind.name in LEVELS:
        codes = LEVELS[kind.name][codes.long()]
    values = codes.to(torch.float32).reshape(len(blocks), groups, -1)
    values.mul_(torch.from_numpy(scales)[..., None])
    if minimums is not None:
        values.add_(torch.from_numpy(minimums)[..., None])
    return values.numpy().reshape(shape)


GROUP_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q5_0": 32, "Q5_1": 32, "Q5_K": 32, "Q6_K": 16, "Q8_0": 32,
               "MXFP4": mxfp4.GROUP}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "MXFP4": 4}
LEVELS = {"MXFP4": mxfp4.LEVELS}  # the formats whose codes index a table of values
SUPPORTED = tuple(GROUP_SIZES)


def unpack(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int], name: str = "") -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) -> its codes, scales and minimums."""
    if kind.name not in GROUP_SIZES:
        raise ValueError(f"{name}: GGUF type {kind.name} has no native kernel in ridge (supported: "
                         f"{', '.join(SUPPORTED)}); load without --quantization gguf to dequantize it")
    n, k = shape
    blocks = _blocks(data, kind)
    scales, minimums = _scales(kind, blocks)
    codes = _codes(kind, _read_only(blocks)).reshape(n, k)
    if kind == GGMLQuantizationType.Q4_0:  # the int4 kernel's codes are unsigned: 0..15 from -8 d
        codes, minimums = (codes + 8).view(torch.uint8), -8 * scales
    elif BITS[kind.name] == 4:
        codes = codes.view(torch.uint8)
    groups = (n, k // GROUP_SIZES[kind.name])
    return QuantizedWeight(
        codes.contiguous(),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(groups))),
        None if minimums is None else torch.from_numpy(np.ascontiguousarray(minimums.reshape(groups))),
        BITS[kind.name], GROUP_SIZES[kind.name], LEVELS.get(kind.name),
    )
