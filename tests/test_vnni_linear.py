"""kernels/vnni_linear.cpp: int8 activations as a matrix kernel on AVX512-VNNI, against the arithmetic it
states (computed here in float64), the bound that arithmetic keeps to the exact layer, and the layouts it reads
(linear/layouts.py's pack_vnni, and torch's int4 layout read back by unpack_int4pack)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_native import cols_for, int8_activation_bound, random_blocks

from ridge.kernels import cpu_ops
from ridge.linear import LinearTarget, make_linear
from ridge.linear.layouts import int4pack_block_width, pack_nibbles, pack_vnni, unpack_int4pack, unpack_nibbles
from ridge.quant import gguf_blocks
from ridge.quant.rtn import dequantize, quantize_int4, quantize_int8

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core

VNNI = "avx512_vnni" in cpu_ops.cpu_flags()


def QuantizedLinear(weight, bias, dtype, ops, **options) -> torch.nn.Module:  # noqa: N802 - make_linear's pick
    return make_linear(weight, bias, LinearTarget(dtype, ops=ops, **options))
needs_vnni = pytest.mark.skipif(not VNNI, reason="the CPU has no AVX512-VNNI: the kernel is not built here")


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the C++ kernels failed to build (is a C++ compiler installed?)"
    assert module.vnni_available() == VNNI
    return module


def test_pack_vnni_layout():
    """Per 16 channels and max(group, 32) columns a record: float16 scales (then minimums) in `unit`s, padded
    to 64 bytes, then chunk c's byte 4 n + j: channel n's code at column 4 c + j (8-bit codes), or at 8 c + j
    with 8 c + 4 + j in the high nibble (4-bit)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 128), generator=g)
    scales, minimums = torch.rand(32, 4, generator=g) * 1e-5, -torch.rand(32, 4, generator=g) * 1e-4
    for bits, step in ((8, 4), (4, 8)):
        packed, unit = pack_vnni(codes, bits, scales, minimums, 32)
        assert packed.shape == (2, 4, 64 + 32 * 64 // step) and packed.dtype == torch.uint8
        assert 2**14 <= minimums.abs().max() / unit < 2**15  # the largest value in float16's top octave
        header = packed[1, 2, :64].view(torch.float16).float() * unit
        assert torch.allclose(header, torch.cat([scales[16:, 2], minimums[16:, 2]]), rtol=2**-11, atol=0)
        for c, n, j in ((0, 0, 0), (3, 5, 2), (32 // step - 1, 15, 3), (2, 9, 1)):
            byte, k = int(packed[1, 2, 64 + 64 * c + 4 * n + j]), 64 + step * c + j
            expected = codes[16 + n, k] if bits == 8 else codes[16 + n, k] | codes[16 + n, k + 4] << 4
            assert byte == expected
    packed, _ = pack_vnni(codes, 8, scales[:, :2], None, 64)  # 64-column groups, scales alone: padded
    assert packed.shape == (2, 2, 64 + 64 * 16)
    packed, _ = pack_vnni(codes, 8, torch.rand(32, 8), None, 16)  # 16-column groups: two per record
    assert packed.shape == (2, 4, 64 + 32 * 16)


@pytest.mark.parametrize("n", [64, 80, 208])
def test_unpack_readers_invert_the_packers(n):
    """pack_nibbles' and torch's CPU int4 layout's readers (full blocks of 32 or 64 channels and a last
    shorter one) give the codes back."""
    codes = torch.randint(0, 16, (n, 128), generator=torch.Generator().manual_seed(n))
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes.to(torch.uint8))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(unpack_int4pack(packed, n, 128, int4pack_block_width()), codes.to(torch.uint8))


def stated_arithmetic(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                      group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vnni_linear.cpp's formula in float64: x rounded per 32 values to dx * q (dx = max |x| / 127, q to
    nearest even, as the kernel computes them in float32), the minimums' term on the float sums; and the
    slack of values within float32 rounding of a tie (x = max / 2 is one), which either side may round
    either way (-ffast-math leaves 127 / max free to take two roundings): dx |w| for each."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    steps = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    dx = (amax / 127).double()
    w = codes.double() * scales.double().repeat_interleave(group, 1)
    y = (torch.round(steps).double() * dx).view(m, k) @ w.T
    if minimums is not None:
        y += x.double() @ minimums.double().repeat_interleave(group, 1).T
    near_tie = ((steps - steps.floor() - 0.5).abs() <= 1e-5 * steps.abs()).double()
    return y, (near_tie * dx).view(m, k) @ w.abs().T


# rows: the register tiles (4 rows, then 1-3); channels: an odd count of 16-blocks takes a one-vector tile
@pytest.mark.parametrize("rows", [1, 6, 11, 32])
@pytest.mark.parametrize("form", ["nibbles", "signed", "unsigned", "signed-g16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_vnni
def test_kernel_computes_its_stated_arithmetic(ops, rows, form, dtype):
    g = torch.Generator().manual_seed(rows)
    n, k, group = 80, 192, {"nibbles": 64, "unsigned": 96, "signed": 192, "signed-g16": 16}[form]
    signed = form.startswith("signed")
    x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 4).to(dtype)
    if form == "nibbles":
        codes = torch.randint(0, 16, (n, k), generator=g)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g) if signed else torch.randint(0, 128, (n, k))
    # scales and minimums that float16 holds exactly (times the packing's power of two)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).half().float()
    minimums = None if form == "signed" else (-torch.rand(n, k // group, generator=g) * 0.1).half().float()
    stored = codes + 128 if signed else codes
    bits = 4 if form == "nibbles" else 8
    packed, unit = pack_vnni(stored, bits, scales, minimums, group)
    weight = ops.VnniWeight(packed, group, bits == 4, signed, minimums is not None, unit)
    got = ops.vnni_linear(x, weight)
    assert got.dtype == dtype and got.shape == (rows, n)
    expected, ties = stated_arithmetic(x, codes, scales, minimums, group)
    # float32: summation order; bfloat16 also the output's rounding, half a unit of its 8-bit mantissa
    tolerance = 1e-5 * expected.abs().max() + ties + (2**-8 * expected.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.double() - expected).abs() <= tolerance).all()


@pytest.mark.parametrize("kind", gguf_blocks.SUPPORTED)
@needs_vnni
def test_layers_move_onto_the_kernel_within_the_int8_bound(ops, kind):
    """Each GGUF format (Q6_K's 16-column groups too), int4 (bfloat16) and int8 per channel: on the integer kernel
    with int8 activations, at every row count, within int8_dot_linear.cpp's bound of the weight (plus float16's
    rounding of scales that are not float16 already)."""
    rows, cols = 48, cols_for(kind)
    qw = gguf_blocks.unpack(random_blocks(kind, rows, cols, seed=1), GGMLQuantizationType[kind], (rows, cols))
    w = torch.randn(48, cols, generator=torch.Generator().manual_seed(2)) * 0.05
    for quantized, dtype in ((qw, torch.float32), (quantize_int4(w, 32), torch.bfloat16),
                             (quantize_int8(w), torch.bfloat16)):
        layer, weight = QuantizedLinear(quantized, None, dtype, ops, int8_activations=True), dequantize(quantized)
        assert layer.kernel == "vnni"
        for tokens in (1, 7, 40):
            x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)).to(layer.dtype)
            expected = x.double() @ weight.double().T
            error = (layer(x).double() - expected).abs()
            rounding = 0 if layer.dtype == torch.float32 else 2**-8  # bfloat16's output rounding
            float16_scales = 2**-11 * x.abs().double() @ weight.abs().double().T  # Q4_K's d * sc, say
            assert (error <= int8_activation_bound(x.float(), weight) + rounding * expected.abs() + float16_scales
                    + 1e-5 * expected.abs().max()).all()
            assert error.max() > 1e-4 * expected.abs().max()  # the integer path really ran


@needs_vnni
def test_a_row_gets_the_same_bits_in_any_batch(ops):
    """Each row's sums run in the same order whatever tile it lands in (4, 3, 2 or 1 rows; one or two channel
    blocks): a request's logits do not depend on what it is batched with, so prefix caching and speculative
    verification see the numbers a lone decode step computes."""
    qw = quantize_int4(torch.randn(80, 192, generator=torch.Generator().manual_seed(3)), 64)
    layer = QuantizedLinear(qw, None, torch.bfloat16, ops, int8_activations=True)
    assert layer.kernel == "vnni"
    x = torch.randn(13, 192, generator=torch.Generator().manual_seed(4)).bfloat16()
    batched = layer(x)
    for i in (0, 5, 6, 12):
        assert torch.equal(layer(x[i:i + 1]), batched[i:i + 1])
    assert torch.equal(layer(x[3:11]), batched[3:11])
