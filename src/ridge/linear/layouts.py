"""The weight layouts ridge's quantized kernels read: 4-bit codes two a byte, torch's CPU int4 layout read
back, and pack_vnni's records (kernels/vnni_linear.cpp, kernels/bf16_dot_linear.cpp)."""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import nn


@cache
def int4pack_block_width() -> int:
    """Output channels per block of torch's CPU int4 layout, which ridge's tiled kernel reads back: 64 where
    torch's kernels run AVX512, 32 on AVX2 (torch picks at run time). Asked of torch itself: channel 32's
    code lands in the first byte only when a block holds 64 channels."""
    codes = torch.zeros(64, 64, dtype=torch.int32)
    codes[32, 0] = 1
    return 64 if torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)[0, 0].item() else 32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (K in 32s) -> uint8 [N, K / 2], two a byte in the order kernels/vec.h states: byte i of
    each 32 columns holds column i (low nibble) and column i + 16 (high)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K / 2] -> codes uint8 [N, K]."""
    n, half = packed.shape
    blocks = packed.view(n, half // 16, 1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def unpack_int4pack(packed: torch.Tensor, n: int, k: int, width: int) -> torch.Tensor:
    """The codes uint8 [N, K] of torch's CPU int4 layout, as kernels/quant_linear.cpp's dequantize_int4pack
    states it (full blocks of `width` channels: byte j of a column holds channel j low and j + width / 2
    high; the last N % width channels: 2 j low, 2 j + 1 high)."""
    flat, full = packed.reshape(-1), n // width * width
    parts = []
    if full:
        block = flat[:full * k // 2].view(full // width, k, width // 2)
        parts.append(torch.cat([block & 0x0F, block >> 4], dim=2).transpose(1, 2).reshape(full, k))
    if n > full:
        block = flat[full * k // 2:].view(k, (n - full) // 2)
        parts.append(torch.stack([block & 0x0F, block >> 4], dim=2).reshape(k, n - full).T)
    return torch.cat(parts).contiguous()


def pack_vnni(codes: torch.Tensor, bits: int, scales: torch.Tensor, minimums: torch.Tensor | None,
              group: int) -> tuple[torch.Tensor, float]:
    """Codes [N, K] (N in 16s, K in 32s; unsigned bytes: signed int8 codes plus 128) with their scales and
    minimums [N, K / group] -> (uint8 [N / 16, K / max(group, 32), record bytes], unit): kernels/vnni_linear.cpp's
    records, each a header of float16 scales (and minimums), in `unit`s, padded to 64 bytes, then the codes in
    64-byte chunks, byte 4 n + j holding channel n's code at k0 + j and, 4-bit codes, at k0 + 4 + j in its high
    nibble."""
    n, k = codes.shape
    blocks, span = n // 16, max(group, 32)
    quads = codes.to(torch.uint8).view(blocks, 16, k // 4, 4).transpose(1, 2)  # [N / 16, K / 4, 16, 4]
    if bits == 4:
        pairs = quads.reshape(blocks, k // 8, 2, 16, 4)
        quads = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    chunks = quads.reshape(blocks, k // span, -1)
    values = [scales] if minimums is None else [scales, minimums]
    top = max(float(v.abs().max()) for v in values)
    unit = 2.0 ** (math.frexp(top)[1] - 15) if top > 0 else 1.0  # the largest value lands in [2^14, 2^15)
    header = torch.cat([(v.float() / unit).reshape(blocks, 16, k // span, -1).permute(0, 2, 3, 1).half()
                        .reshape(blocks, k // span, -1).contiguous().view(torch.uint8) for v in values], dim=-1)
    header = nn.functional.pad(header, (0, -header.shape[-1] % 64))
    return torch.cat([header, chunks], dim=-1).contiguous(), unit
