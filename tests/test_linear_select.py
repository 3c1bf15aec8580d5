"""linear/select.py's one decision: which layer a weight gets for (format, dtype, device, CPU features, options)."""

import pytest
import torch
from torch import nn

from ridge.linear import (
    Bf16DotLinear,
    FewRowsLinear,
    Fp8Linear,
    GroupedInt8Linear,
    Int4Linear,
    Int8Linear,
    LinearTarget,
    PackedLinear,
    VnniLinear,
    make_linear,
    model_weight_bytes,
)
from ridge.linear.dense import onednn_packs
from ridge.linear.triton import TritonQuantLinear
from ridge.quant.rtn import quantize_fp8, quantize_int4, quantize_int8


def pick(weight, dtype=torch.bfloat16, **target) -> type:
    return type(make_linear(weight, None, LinearTarget(dtype, **target)))


def test_dense_weights(ops):
    w = nn.Parameter(torch.randn(64, 96), requires_grad=False)
    assert pick(w, torch.float32, ops=ops) is FewRowsLinear
    assert pick(w, torch.float32) is nn.Linear  # no ridge kernels: torch's own
    bf16 = nn.Parameter(w.data.bfloat16(), requires_grad=False)
    # where oneDNN cannot pack bf16 (no AVX512), torch's bf16 matmul is a slow loop: the few-row layer's road
    packs = onednn_packs(torch.bfloat16, "cpu")
    assert pick(bf16, ops=ops) is (PackedLinear if packs else FewRowsLinear)
    assert pick(bf16, ops=ops, packed=False) is (nn.Linear if packs else FewRowsLinear)
    assert pick(bf16) is (PackedLinear if packs else nn.Linear)  # oneDNN's packing is torch's, not ridge's kernels


def test_quantized_weights(ops):
    w = torch.randn(64, 96)
    int4, int8, fp8 = quantize_int4(w, 32), quantize_int8(w), quantize_fp8(w)
    assert pick(fp8, ops=ops) is Fp8Linear
    assert pick(int4, torch.float32, ops=ops) is GroupedInt8Linear  # float32: ridge's grouped kernel, every format
    assert pick(int4) is Int4Linear and pick(int8) is Int8Linear  # no ridge kernels: torch's
    assert pick(int4, device="cuda") is TritonQuantLinear and pick(fp8, device="cuda") is TritonQuantLinear
    if ops.bf16_dot_available():
        assert pick(int4, ops=ops) is Bf16DotLinear and pick(int8, ops=ops) is Bf16DotLinear
    assert pick(int4, ops=ops, bf16_dot=False) is Int4Linear
    assert pick(quantize_int4(torch.randn(72, 96), 32), ops=ops) is Int4Linear  # 72 channels: not in 16s


def test_mxfp4_levels(ops, caplog):
    """4-bit codes through a table (MXFP4) go to ridge's grouped kernel, which looks them up as held, and on CUDA to
    the Triton kernels' e2m1 codes; where no kernel has the lookup (int8 activations) they are widened to int8
    codes, the same numbers, and it says so."""
    from ridge.linear.select import _warn_levels_widened
    from ridge.quant import mxfp4

    _warn_levels_widened.cache_clear()  # said once a process
    weight = mxfp4.from_hf(*mxfp4.to_hf(torch.randn(64, 96)))
    for dtype in (torch.float32, torch.bfloat16):
        layer = make_linear(weight, None, LinearTarget(dtype, ops=ops))
        assert isinstance(layer, GroupedInt8Linear) and layer.levels.numel() == 16 and layer.qweight.shape == (64, 48)
    assert "no table-lookup kernel" not in caplog.text
    wide_rows = mxfp4.from_hf(*mxfp4.to_hf(torch.randn(64, 128)))  # each half of a row's nibbles a whole block
    assert make_linear(wide_rows, None, LinearTarget(torch.bfloat16, device="cuda")).kernel == "triton_mxfp4"
    assert "no table-lookup kernel" not in caplog.text
    assert make_linear(weight, None, LinearTarget(torch.bfloat16, device="cuda")).kernel == "triton_int5"
    assert "no table-lookup kernel on cuda" in caplog.text
    wide = make_linear(weight, None, LinearTarget(torch.float32, ops=ops, int8_activations=True))
    assert getattr(wide, "levels", torch.empty(0)).numel() == 0 and "with int8 activations" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_scales_are_held_as_exponent_bytes(ops, dtype):
    """MXFP4's power-of-two scales held as their exponent bytes (a quarter of the float32 bytes): bit for bit the
    float scales' results, on the register path (up to 8 rows, 32 in float32) and the dequantized tiles; a scale
    that is no normal power of two (2^-128, a float32 subnormal; a GGUF block's e8m0 can hold it) keeps the
    layer's scales in float32."""
    from ridge.linear.quantized import exponent_bytes
    from ridge.quant import mxfp4

    weight = mxfp4.from_hf(*mxfp4.to_hf(torch.randn(64, 128) * 0.02))
    layer = make_linear(weight, None, LinearTarget(dtype, ops=ops))
    floats = weight.scales.float().reshape(64, -1).contiguous()
    assert layer.scales.dtype == torch.uint8 and layer.scales.nbytes * 4 == floats.nbytes
    for rows in (1, 3, 9, 40):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        expected = ops.grouped_int8_linear(x, layer.qweight, floats, layer.minimums, 32, layer.levels)
        assert torch.equal(layer(x), expected), rows
    tiny = floats.clone()
    tiny[0, 0] = 2.0**-128
    assert exponent_bytes(tiny) is tiny and exponent_bytes(-floats).dtype == torch.float32  # a sign: no byte for it
    assert exponent_bytes(floats * 1.5).dtype == torch.float32  # not powers of two
    with pytest.raises(RuntimeError, match="uint8 exponent bytes"):  # the bytes mean scales only beside levels
        ops.grouped_int8_linear(x, layer.qweight, layer.scales, layer.minimums, 32, torch.empty(0, dtype=torch.int8))


def test_int8_activations(ops):
    int4 = quantize_int4(torch.randn(64, 96), 32)
    if ops.vnni_available():
        assert pick(int4, ops=ops, int8_activations=True) is VnniLinear
        assert pick(int4, torch.float32, ops=ops, int8_activations=True) is VnniLinear
    odd = make_linear(quantize_int4(torch.randn(40, 96), 32), None,
                      LinearTarget(torch.float32, ops=ops, int8_activations=True))
    assert isinstance(odd, GroupedInt8Linear) and odd.int8_activations == ops.int8_dot_available()


def test_model_weight_bytes_count_a_tied_table_once(smollm2):
    model = smollm2.engine.loaded.model
    layers = sum(p.nbytes for p in model.layers.parameters())
    assert model_weight_bytes(model) == layers + model.output_weight.nbytes
