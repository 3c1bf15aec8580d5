"""torch's CUDA int4 layout (linear/int4pack.py), read back on the CPU: unpack() inverts the layout that torch's
CUDA packing kernel writes, here reproduced from that kernel's index arithmetic (the CUDA kernel itself and
tinygemm's products run in tests/test_cuda.py on a GPU), and the scale / zero-point convention is the one
torch's CPU form of the same matmul computes."""

from __future__ import annotations

import torch

from ridge.linear import int4pack
from ridge.quant.rtn import dequantize, quantize_int4


def cuda_layout(q: torch.Tensor, inner_k_tiles: int = int4pack.INNER_K_TILES) -> torch.Tensor:
    """What torch's `_convert_weight_to_int4pack` (CUDA) makes of codes q [N, K]: bytes holding k even high and k
    odd low; lane t of n-tile nt and k-tile pair p of outer tile ko packs the bytes at columns
    ko * 8 * inner + 16 p + (0, 4, 8, 12) + t % 4 of row 8 nt + t // 4, high nibbles in bits 0-15, low in 16-31."""
    n, k = q.shape
    pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.int64)
    out = torch.zeros(n // 8, k // (16 * inner_k_tiles), 32, inner_k_tiles // 2, dtype=torch.int64)
    t = torch.arange(32)
    for nt in range(n // 8):
        for ko in range(out.shape[1]):
            for p in range(inner_k_tiles // 2):
                base = (ko * inner_k_tiles + 2 * p) * 8 + t % 4
                v = [pairs[nt * 8 + t // 4, base + offset] for offset in (0, 4, 8, 12)]
                word = torch.zeros(32, dtype=torch.int64)
                for j in range(4):
                    word |= ((v[j] & 0xF) << (16 + 4 * j)) | (((v[j] & 0xF0) >> 4) << (4 * j))
                out[nt, ko, :, p] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # the int32 bits


def test_unpack_inverts_the_cuda_layout():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (24, 256), dtype=torch.uint8)
    assert torch.equal(int4pack.unpack(cuda_layout(q)), q)


def test_dense_matches_the_dequantized_weight_and_torchs_cpu_int4_matmul():
    torch.manual_seed(1)
    weight = quantize_int4(torch.randn(16, 256) * 0.2, 32)
    scales = weight.scales.float()
    zeros = 8 * scales + weight.minimums.float()
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16)
    w = int4pack.dense(cuda_layout(weight.qweight), scales_and_zeros, 32, torch.float32)
    exact = dequantize(weight)
    assert (w - exact).abs().max().item() < 2e-2 * exact.abs().max().item()  # bfloat16 scales and zero points
    x = torch.randn(3, 256).bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.qweight.to(torch.int32), 8)
    cpu = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros.contiguous())
    ours = x.float() @ w.T
    assert (cpu.float() - ours).abs().max().item() < 1e-2 * ours.abs().max().item()


def test_dense_widens_in_chunks_the_same(monkeypatch):
    torch.manual_seed(2)
    weight = quantize_int4(torch.randn(24, 128), 32)
    scales_and_zeros = torch.stack([weight.scales.t(), (8 * weight.scales + weight.minimums).t()], -1).bfloat16()
    whole = int4pack.dense(cuda_layout(weight.qweight), scales_and_zeros, 32, torch.float32)
    monkeypatch.setattr(int4pack, "DENSE_TILES", 1)  # three chunks of 8 rows
    assert torch.equal(int4pack.dense(cuda_layout(weight.qweight), scales_and_zeros, 32, torch.float32), whole)
