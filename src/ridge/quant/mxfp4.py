"""MXFP4 (OCP microscaling, 4-bit floats): blocks of 32 weights, each an e2m1 number (0, 0.5, 1, 1.5, 2, 3, 4,
6 and their negatives) times its block's power of two, an e8m0 byte e: 2^(e - 127). gpt-oss ships its experts in
it; llama.cpp's GGUF type MXFP4 holds the same numbers.

Doubled, the e2m1 numbers are integers, -12..12, so a block is LEVELS[index] * 2^(e - 128): a QuantizedWeight of
4-bit codes with LEVELS as its table and a scale per group of 32, exactly. ridge's grouped CPU kernel reads the
codes as held, two a byte, and looks each up in a register (kernels/quant_linear.cpp); CUDA's Triton kernels
decode them from their bits (triton_kernels/quant_matmul.py's e2m1 codes); kernels with neither (int8 activations)
take the levels as int8 codes a byte each (rtn.with_codes_as_levels).

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


def scales(exponents: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents -> float32 2^(e - 128), the scale of the doubled codes (exact: 2^-128 is a float32
    subnormal)."""
    return torch.pow(2.0, exponents.to(torch.float64) - 128).float()


def from_hf(blocks: torch.Tensor, exponents: torch.Tensor) -> QuantizedWeight:
    """One matrix of an HF checkpoint: blocks uint8 [N, K / 32, 16], exponents uint8 [N, K / 32] -> its codes
    (one a byte, in column order), levels and scales."""
    n, groups, _ = blocks.shape
    indices = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, groups * GROUP)
    return QuantizedWeight(indices.contiguous(), scales(exponents).contiguous(), None, 4, GROUP, LEVELS)


def quantize(weight: torch.Tensor) -> QuantizedWeight:
    """A float matrix [N, K] (K in 32s) at its nearest MXFP4 numbers: gguf's quantization, a few hundred rows at a
    time (gguf compares each weight with all 16 levels at once: 64 bytes of scratch a weight)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"quantization: mxfp4's blocks are {GROUP} input columns; a weight has {k}")
    parts = [from_hf(*to_hf(rows)) for rows in weight.split(max(1, (1 << 22) // k))]
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), None, 4,
                           GROUP, LEVELS)


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
