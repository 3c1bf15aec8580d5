"""MXFP4 (OCP microscaling, 4-bit floats): blocks of 32 weights, each an e2m1 number (0, 0.5, 1, 1.5, 2, 3, 4,
6 and their negatives) times its block's power of two, an e8m0 byte e: 2^(e - 127). gpt-oss ships its experts in
it; llama.cpp's GGUF type MXFP4 holds the same numbers.

Doubled, the e2m1 numbers are integers, -12..12, so a block is codes * 2^(e - 128): an int8 code per weight and a
scale per group of 32, exactly, which the grouped-code kernels of the other GGUF formats run as they are
(kernels/quant_linear.cpp, the Triton one on CUDA). A code takes a byte there, not half of one: the kernels have no
table lookup for the 4-bit index.

Two layouts of the same bits, differing in where a block's exponent sits and in the order of its nibbles:
  GGUF  a block is 17 bytes: e, then 16 bytes, byte i holding value i (low nibble) and value 16 + i (high)
  HF    <name>_blocks uint8 [..., N, K / 32, 16], byte i holding value 2i (low) and 2i + 1 (high), and
        <name>_scales uint8 [..., N, K / 32], the exponents
A nibble is an index into LEVELS (sign in its top bit).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from ridge.quant.rtn import QuantizedWeight

GROUP = 32
LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)  # doubled
# The bits a code is held in: its 25 levels span 5 (as GGUF's Q5 formats' codes do, a byte each)
CODE_BITS = 5


def scales(exponents: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents -> float32 2^(e - 128), the scale of the doubled codes (exact: 2^-128 is a float32
    subnormal)."""
    return torch.pow(2.0, exponents.to(torch.float64) - 128).float()


def codes(indices: torch.Tensor) -> torch.Tensor:
    """4-bit indices (any integer tensor) -> their doubled e2m1 values, int8."""
    return LEVELS[indices.long()]


def from_hf(blocks: torch.Tensor, exponents: torch.Tensor) -> QuantizedWeight:
    """One matrix of an HF checkpoint: blocks uint8 [N, K / 32, 16], exponents uint8 [N, K / 32] -> its codes
    and scales."""
    n, groups, _ = blocks.shape
    indices = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, groups * GROUP)
    return QuantizedWeight(codes(indices).contiguous(), scales(exponents).contiguous(), None, CODE_BITS, GROUP)


def to_hf(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [..., N, K] -> HF's (blocks, scales): gguf's MXFP4 quantization (a block's exponent from its
    largest magnitude, each weight the nearest level), repacked in HF's order. Writes test checkpoints."""
    *lead, n, k = weight.shape
    raw = gguf_quantize(weight.float().reshape(-1, k).numpy(), GGMLQuantizationType.MXFP4)
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, k // GROUP, 1 + GROUP // 2)
    exponents, packed = blocks[..., 0], blocks[..., 1:]
    indices = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # GGUF's order: values 0..15, then 16..31
    pairs = indices.reshape(*indices.shape[:-1], GROUP // 2, 2)
    hf_blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return (hf_blocks.reshape(*lead, n, k // GROUP, GROUP // 2).contiguous(),
            exponents.reshape(*lead, n, k // GROUP).contiguous())
