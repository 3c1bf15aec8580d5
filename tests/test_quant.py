"""Weight-only quantization: each format's kernel against dequantize-then-matmul, and the model swap."""

from __future__ import annotations

import pytest
import torch

from ridge.eval.perplexity import from_logits, perplexity
from ridge.linear import KernelLinear, LinearTarget, make_linear
from ridge.quant.methods import quantize_weight
from ridge.quant.rtn import FP8_STRETCHES, INT8_STRETCHES, dequantize, quantize_fp8, quantize_int4, quantize_int8

# (tokens, in, out): odd sizes; from 16 tokens on, bf16 takes ridge's tiled kernels, whose int4 reading of
# torch's layout has a last block of N % 64 channels (160: 32, 77 -> 80: 16) and whose tiles hold 4 MB
# (40016 x 64: two tiles, the second ending in a 16-channel block)
SHAPES = [(1, 64, 32), (3, 192, 77), (17, 256, 160), (64, 576, 960), (33, 64, 77), (20, 64, 40016)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "group_size"), [("int8", 32), ("int4", 32), ("int4", 64), ("fp8", 32),
                                                    ("mxfp4", 32)])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_kernel_equals_dequantize_then_matmul(ops, method, group_size, dtype, m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    weight = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    qw = quantize_weight(weight, method, group_size)
    layer = make_linear(qw, bias, LinearTarget(dtype, ops=ops))
    assert layer.kernel not in ("", "dequantized")
    expected = x.float() @ dequantize(qw).T + bias.float()
    got = layer(x).float()
    # float32: the kernels' own rounding only; bf16: activations and scales are rounded to 8 bits of mantissa
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_rtn_error_bounds():
    w = torch.randn(64, 256) * 0.1
    q8 = quantize_int8(w)
    assert (dequantize(q8) - w).abs().max() <= q8.scales.max() / 2 + 1e-7  # within half a step
    for integer_zeros in (False, True):
        q4 = quantize_int4(w, 32, integer_zeros)
        # half a step, and the top of the range may miss by 15 times the scale's float16 rounding
        assert (dequantize(q4) - w).abs().max() <= q4.scales.max() * (0.5 + 15 * 2**-11) + 1e-6
        assert q4.qweight.max() <= 15
    assert q8.qweight.abs().max() <= 127


def test_mxfp4_rounds_each_weight_to_a_nearest_level():
    """--quantization mxfp4: every weight within half the widest gap of its block's levels (2 of the doubled steps:
    between 8 and 12), or, above the top level, clipped to it (the OCP spec's exponent, gguf's: a block's largest
    magnitude in [8, 16) steps, so up to a quarter of it clipped); its blocks are 32 columns, another group size
    refused by name."""
    from ridge.config import EngineConfig

    w = torch.randn(48, 256) * torch.logspace(-3, 1, 48)[:, None]
    q = quantize_weight(w, "mxfp4", 32)
    assert q.levels is not None and q.qweight.max() <= 15 and q.group_size == 32
    step = q.scales.repeat_interleave(32, dim=1)
    error, top = (dequantize(q) - w).abs(), 12 * step
    assert (error[w.abs() <= top] <= 2 * step[w.abs() <= top] + 1e-12).all()
    assert torch.equal(dequantize(q)[w.abs() > top].abs(), top[w.abs() > top]) and (w.abs() < 16 * step).all()
    with pytest.raises(ValueError, match="quantization_group_size: mxfp4's blocks are 32 input columns, not 64"):
        EngineConfig(model="smollm2", quantization="mxfp4", quantization_group_size=64)
    with pytest.raises(ValueError, match="calibration_windows: mxfp4 rounds each weight to its nearest level"):
        EngineConfig(model="smollm2", quantization="mxfp4", calibration_windows=8)


def test_mxfp4_rounding_is_gguf_s_bit_for_bit():
    """quant/mxfp4.py's rounding (two candidate levels a weight, in torch) against gguf's (all 16 errors, in numpy),
    exponents and codes equal: random weights over 40 binary orders of magnitude, blocks of zeros and negative zeros,
    and weights exactly on the levels and on the midpoints between them (ties), and one float step either side."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from ridge.quant import mxfp4

    g = torch.Generator().manual_seed(0)
    spread = torch.randn(256, 512, generator=g) * torch.logspace(-20, 20, 256, base=2.0)[:, None]
    half = 2.0**-8  # blocks whose largest magnitude is 8 half-steps: exponent 2^-8's
    doubled = torch.tensor([0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12])  # levels and midpoints
    exact = (doubled * half).repeat(1, 3)[:, :32].expand(64, 32).clone()
    exact[:, 0] = 8 * half
    sign = torch.where(torch.rand(64, 32, generator=g) < 0.5, -1.0, 1.0)
    sign[:, 0] = 1.0
    ties = exact * sign
    steps = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    steps[:, 0] = 8 * half
    zeros = torch.zeros(4, 64)
    zeros[1] = -0.0
    for w in (spread, steps.reshape(-1, 64), zeros):
        raw = gguf_quantize(w.numpy(), GGMLQuantizationType.MXFP4).reshape(-1, 17)
        nibbles = torch.from_numpy(np.ascontiguousarray(raw[:, 1:]))
        expected = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # gguf's order: values 0..15, then 16..31
        indices, exponents = mxfp4.blocks(w)
        assert torch.equal(exponents.flatten(), torch.from_numpy(raw[:, 0].copy()))
        assert torch.equal(indices.reshape(-1, 32), expected)


def test_int4_float_minimums_find_a_q4_1_grid_again():
    """Weights already on a 16-level grid per 32 columns with a float minimum (a GGUF Q4_1 block, float16
    scale and minimum) come back exactly from float-minimum int4 at group 32; integer zero points cannot
    place the grid there and miss by up to half a step. And a checkpoint refuses float minimums."""
    g = torch.Generator().manual_seed(7)
    scales = (torch.rand(24, 4, generator=g) * 0.01 + 0.001).half().float()
    minimums = (-torch.rand(24, 4, generator=g) * 0.1).half().float()
    codes = torch.randint(0, 16, (24, 4, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # every block spans its whole grid, as Q4_1 blocks do
    w = (codes * scales[..., None] + minimums[..., None]).view(24, 128)
    float_form = quantize_int4(w, 32)
    torch.testing.assert_close(dequantize(float_form), w, rtol=0, atol=1e-6)
    integer_form = quantize_int4(w, 32, integer_zeros=True)
    error = (dequantize(integer_form) - w).abs().amax(dim=1)
    assert error.min() > 0.05 * scales.min() and error.max() <= integer_form.scales.max() / 2 + 1e-6
    from ridge.quant.checkpoint import pack_gptq

    with pytest.raises(ValueError, match="not integer zero points"):
        pack_gptq(float_form)


@pytest.mark.parametrize(("method", "widest"), [("int8", INT8_STRETCHES[-1]), ("fp8", FP8_STRETCHES[-1])])
def test_importance_weighted_scales_spare_the_loud_columns(method: str, widest: float):
    """Three input columns with mean squares 1e4 times the others' (real layers have such: quant/rtn.py): the
    scales chosen by importance cut the importance-weighted error, the layer's output error on such inputs,
    far below RTN's. No weight is clipped (scales from RTN's to `widest` times it), every code is still the
    nearest one, and on flat importance the error is RTN's."""
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.05
    loud = torch.rand(512) + 0.5
    loud[[3, 100, 400]] = 1e4
    flat = torch.rand(512) + 0.5
    quantize = quantize_int8 if method == "int8" else quantize_fp8

    def error(qw, importance: torch.Tensor) -> float:
        return float(((w - dequantize(qw)).square() * importance).sum())

    rtn, weighted = quantize(w), quantize(w, loud)
    assert error(weighted, loud) < 0.3 * error(rtn, loud)
    ratio = weighted.scales / rtn.scales
    assert ratio.min() >= 1 - 1e-3 and ratio.max() <= widest * (1 + 1e-3) and (ratio > 1.01).float().mean() > 0.5
    if method == "int8":
        assert torch.equal(weighted.qweight.float(), torch.round(w / weighted.scales[:, None]).clamp(-127, 127))
    else:
        assert torch.equal(weighted.qweight.float(), (w / weighted.scales[:, None]).to(torch.float8_e4m3fn).float())
    assert error(quantize(w, flat), flat) <= 1.02 * error(rtn, flat)


def test_group_size_must_divide_the_dimension():
    with pytest.raises(ValueError, match=r"group_size: 128 does not divide the input dimension 576.*32, 64"):
        quantize_int4(torch.randn(8, 576), 128)
    with pytest.raises(ValueError, match=r"dimension 48; none of 32, 64, 128 does: quantize per channel"):
        quantize_int4(torch.randn(8, 48), 32)
    with pytest.raises(ValueError, match="group_size: 48 is not one of 32, 64, 128"):
        quantize_int4(torch.randn(8, 96), 48)
    with pytest.raises(ValueError, match="quantization: 'int3' is not one of int8, int4"):
        quantize_weight(torch.randn(8, 96), "int3", 32)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_smollm2_kernels_match_its_dequantized_weights(make_llm_for_test, smollm2_path, method):
    """The whole model: logits through the kernels equal logits through the same quantized weights
    dequantized (float32), and stay close to the unquantized model (RTN's own error)."""
    plain_rtn = {"calibration_windows": 0} if method != "int4" else {}  # int4 at load is RTN already
    llm = make_llm_for_test(smollm2_path, dtype="float32", quantization=method, quantization_group_size=64,
                            **plain_rtn)  # the kernels are what is checked, not the rounding
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    fast = llm.engine.prompt_logits(ids)
    model = llm.engine.loaded.model
    for name, module in list(model.named_modules()):
        if isinstance(module, KernelLinear):
            parent_name, _, child = name.rpartition(".")
            plain = torch.nn.Linear(module.in_features, module.out_features, bias=False, dtype=module.dtype)
            plain.weight = torch.nn.Parameter(_dense(module), requires_grad=False)
            plain.bias = module.bias
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    slow = llm.engine.prompt_logits(ids)
    assert (fast - slow).abs().max() <= 1e-3 * slow.abs().max()


def _dense(layer: KernelLinear) -> torch.Tensor:
    """The kernel layout back to a dense matrix: multiply the identity through the kernel."""
    eye = torch.eye(layer.in_features, dtype=layer.dtype)
    bias, layer.bias = layer.bias, None
    dense = layer(eye).T.contiguous()
    layer.bias = bias
    return dense


def test_perplexity_windows_score_every_token_once():
    vocab, n = 11, 50
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=g)  # a bigram model: logits depend on the previous token
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    seen = []

    def logits_fn(window: list[int]) -> torch.Tensor:
        seen.append(len(window))
        return table[torch.tensor(window)]

    result = perplexity(from_logits(logits_fn), ids, window=16, stride=8, progress=False)
    logp = table[torch.tensor(ids[:-1])].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    assert result.tokens == n - 1
    assert result.nll == pytest.approx(-float(logp.sum()), rel=1e-5)
    assert max(seen) == 16
