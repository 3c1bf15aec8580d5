"""torch's CUDA int4 matmul (`_weight_int4pack_mm`, tinygemm) and its packed layout: packing a QuantizedWeight
into it, multiplying by it, and reading it back as a dense matrix for many rows.

tinygemm runs the tensor cores on 16-row tiles, widening the nibbles by bit tricks: at a few rows it is the
fastest int4 GEMV ridge has on the GPU (docs/notes/gpu.md), but it widens the whole matrix again for every 16
rows, so a prefill is better served by widening the matrix once and calling cuBLAS. Its layout for 8 inner
k-tiles (packed by torch's `_convert_weight_to_int4pack` from bytes holding k even in their high nibble and
k odd in their low one) is int32 [N / 8, K / 128, 32 lanes, 4], lane t = 4r + c holding row 8 * tile + r, and
the word's nibble b = j + 4h holding k = 128 * outer + 32 * i + 8 * j + 2 * c + h (i the word's index);
unpack() inverts that with shifts and one permutation. Scales and zero points are [K / group, N, 2] bfloat16,
w = (q - 8) * scale + zero.
"""

from __future__ import annotations

import torch

from ridge.quant.rtn import QuantizedWeight

GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 8  # 16-byte loads of codes, the widest (gpt-fast's choice)


def fits(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether tinygemm takes this weight: bfloat16 activations, its group sizes, and K in whole tiles of
    16 x INNER_K_TILES columns, N in tiles of 8 rows."""
    n, k = weight.shape
    return (dtype == torch.bfloat16 and weight.bits == 4 and weight.levels is None and weight.group_size in GROUPS
            and k % (16 * INNER_K_TILES) == 0 and n % 8 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm"))


def pack(weight: QuantizedWeight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in tinygemm's layout, scales and zero points), made on the GPU: the CPU's int4 layout differs.
    The zero point carries the minimum and the code offset, rounded to bfloat16 (a relative 2^-9 of a group's
    range, well inside int4's rounding)."""
    q = weight.qweight.to(device=device, dtype=torch.uint8)
    pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    scales = weight.scales.to(device).float()
    zeros = 8 * scales + (weight.minimums.to(device).float() if weight.minimums is not None else 0)
    return packed, torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def multiply(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] bfloat16 (contiguous) -> [M, N] on tinygemm."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """tinygemm's layout -> the codes, uint8 [N, K] in 0..15."""
    tiles, outer = packed.shape[:2]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [N/8, K/128, lane, word, nibble]
    nibbles = nibbles.view(tiles, outer, 8, 4, INNER_K_TILES // 2, 2, 4)  # lane -> (r, c), nibble -> (h, j)
    n, k = tiles * 8, outer * 16 * INNER_K_TILES
    return nibbles.permute(0, 2, 1, 4, 6, 3, 5).reshape(n, k).to(torch.uint8)  # [tile, r][outer, i, j, c, h]


DENSE_TILES = 1024  # n-tiles (8 rows each) widened at a time: the int32 and float32 temporaries stay ~0.3 GB


def dense(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized matrix [N, K] in `dtype`."""
    tiles, outer = packed.shape[:2]
    n, k = tiles * 8, outer * 16 * INNER_K_TILES
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    scales, zeros = (t.t()[:, :, None] for t in scales_and_zeros.unbind(-1))  # [N, groups, 1]
    for first in range(0, tiles, DENSE_TILES):
        rows = slice(8 * first, 8 * min(first + DENSE_TILES, tiles))
        q = unpack(packed[first:first + DENSE_TILES]).view(-1, k // group_size, group_size)
        w = (q.float() - 8) * scales[rows].float() + zeros[rows].float()
        out[rows] = w.view(-1, k)
    return out
