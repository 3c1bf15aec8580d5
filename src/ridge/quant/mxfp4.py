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

import torch

from ridge.quant.rtn import QuantizedWeight

GROUP = 32
LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)  # doubled


def scales(exponents: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents -> float32 2^(e - 128), the scale of the doubled codes, made from its bits as ggml makes it
    (ggml_e8m0_to_fp32_half): e < 2 are float32 subnormals, exact."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def from_hf(blocks: torch.Tensor, exponents: torch.Tensor) -> QuantizedWeight:
    """One matrix of an HF checkpoint: blocks uint8 [N, K / 32, 16], exponents uint8 [N, K / 32] -> its codes
    (one a byte, in column order), levels and scales."""
    n, groups, _ = blocks.shape
    indices = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, groups * GROUP)
    return QuantizedWeight(indices.contiguous(), scales(exponents).contiguous(), None, 4, GROUP, LEVELS)


def quantize(weight: torch.Tensor) -> QuantizedWeight:
    """A float matrix [N, K] (K in 32s) at its nearest MXFP4 numbers, gguf's rounding bit for bit (blocks())."""
    n, k = weight.shape
    indices, exponents = blocks(weight)
    return QuantizedWeight(indices.reshape(n, k), scales(exponents), None, 4, GROUP, LEVELS)


def blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [..., N, K] -> each weight's index into LEVELS uint8 [..., N, K / 32, 32] and each block's
    exponent uint8 [..., N, K / 32]: gguf's MXFP4 quantization (gguf.quants.MXFP4), bit for bit, in torch: the
    exponent e = floor(log2(max |w|)) - 2 + 127 (0 for a block of zeros), and each weight the level whose product with
    the block's half-scale h is nearest, the first of equals. gguf measures all 16 errors |h L - w| (64 bytes of
    scratch a weight); only the two magnitudes around |w| / h can be the
    nearest, and |h L - w| = |h |L| - |w|| for levels of w's sign, so those two errors decide, ties to the smaller
    magnitude (the first index); a negative weight's level is its magnitude's index + 8, except 0 (index 0 comes
    first)."""
    *lead, n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"quantization: mxfp4's blocks are {GROUP} input columns; a weight has {k}")
    rows = weight.float().reshape(-1, k // GROUP, GROUP)
    magnitudes = LEVELS[:8].float().to(weight.device)  # 0, 1, 2, 3, 4, 6, 8, 12: ascending
    indices, exponents = [], []
    for part in rows.split(max(1, (1 << 22) // k)):
        amax = part.abs().amax(-1)
        exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0).to(torch.uint8)
        half = scales(exponent).unsqueeze(-1)
        size = part.abs()
        below = (torch.searchsorted(magnitudes, size / half, right=True) - 1).clamp_(0, 7)
        above = (below + 1).clamp_(max=7)
        nearer = (half * magnitudes[above] - size).abs() < (half * magnitudes[below] - size).abs()
        index = torch.where(nearer, above, below)
        indices.append(torch.where((part < 0) & (index > 0), index + 8, index).to(torch.uint8))
        exponents.append(exponent)
    return (torch.cat(indices).reshape(*lead, n, k // GROUP, GROUP),
            torch.cat(exponents).reshape(*lead, n, k // GROUP))


def to_hf(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [..., N, K] -> HF's (blocks, scales): blocks() packed in HF's order (value 2i in byte i's low
    nibble, 2i + 1 in its high). Writes test checkpoints."""
    indices, exponents = blocks(weight)
    pairs = indices.reshape(*indices.shape[:-1], GROUP // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous(), exponents.contiguous()
