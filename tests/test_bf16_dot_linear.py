"""kernels/bf16_dot_linear.cpp: the exact 4- and 8-bit linear for bfloat16 activations on AVX512-BF16, over
pack_vnni's layout: against dequantize-then-matmul in float64, on the layers that take it by default (RTN int4 and
int8, GGUF's 4-bit formats and Q8_0), and its refusals; and the same layout's paths for many rows
(kernels/quant_linear.cpp: tiles dequantized to bf16 on oneDNN's matmul, vnni_tiled_linear, or the whole weight
into a scratch in oneDNN's packed form, vnni_dequantize_onednn_)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_native import random_blocks
from torch import nn

from ridge.kernels import cpu_ops
from ridge.linear import LinearTarget, QuantizedEmbedding, make_linear
from ridge.linear.dense import prompt_scratch
from ridge.linear.layouts import pack_vnni
from ridge.linear.rows import BF16_DOT_TILED_MIN_ROWS
from ridge.linear.select import share_prompt_scratch
from ridge.quant import gguf_blocks
from ridge.quant.rtn import dequantize, quantize_int4, quantize_int8

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core

BF16_DOT = "avx512_bf16" in cpu_ops.cpu_flags()
PANEL_MIN_ROWS = 8  # bf16_dot_linear.cpp's kPanelMinRows: 8-bit codes converted once to bf16 from this many rows
SEVEN_BIT_PANEL_MIN_ROWS = 24  # its kSevenBitPanelMinRows: 7-bit codes too from this many
def QuantizedLinear(weight, bias, dtype, ops, **options) -> nn.Module:  # noqa: N802 - the layer make_linear picks
    return make_linear(weight, bias, LinearTarget(dtype, ops=ops, **options))


needs_bf16_dot = pytest.mark.skipif(not BF16_DOT, reason="the CPU has no AVX512-BF16: the kernel is not built here")


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the C++ kernels failed to build (is a C++ compiler installed?)"
    assert module.bf16_dot_available() == BF16_DOT
    return module


def tolerance(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """bfloat16's rounding of the output (half a unit of its 8-bit mantissa, taken whole), plus float32's of sums
    that carry each code with an excess (128 + code for 4-bit codes and 7-bit ones, 192 + code if signed; 2176 +
    code for 8-bit ones as two nibbles, 2304 + code if signed): 2^-16 of the sum of |x| times |w| + excess * scale
    (`offsets`), ~2^-24 per term over a few hundred terms."""
    return 2**-8 * expected.abs() + 2**-16 * x.abs().double() @ (weight.abs() + offsets).double().T


# (bits, signed codes): 4-bit codes are unsigned; 8-bit ones either (signed: stored plus 128); 7: 8-bit codes of at
# most 7 bits (GGUF's 5- and 6-bit formats: VnniWeight's seven_bit, each code one bf16)
CODES = {(4, False): (0, 16), (8, False): (0, 256), (8, True): (-128, 128), (7, False): (0, 128), (7, True): (-64, 64)}


def random_codes(bits: int, signed: bool, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] and what pack_vnni stores of them (unsigned bytes)."""
    codes = torch.randint(*CODES[bits, signed], (n, k), generator=g)
    return codes, codes + 128 if signed else codes


# what the kernel's sums carry beyond each code, by CODES' key (the tolerance's docstring says why)
EXCESS = {(4, False): 128, (8, False): 2176, (8, True): 2304, (7, False): 128, (7, True): 192}


def vnni_weight(ops, codes: torch.Tensor, bits: int, signed: bool, scales: torch.Tensor,
                minimums: torch.Tensor | None, group: int):
    """pack_vnni's layout of codes as `bits` (CODES) says, as the kernel takes it."""
    packed, unit = pack_vnni(codes, 4 if bits == 4 else 8, scales, minimums, group)
    return ops.VnniWeight(packed, group, bits == 4, signed, minimums is not None, unit, seven_bit=bits == 7)


# (bits, signed codes, group): groups of 32s, and 8-bit codes in Q6_K's groups of 16 (two a record)
LAYOUTS = [(bits, signed, group) for bits, signed in CODES for group in (16, 32, 64, 256) if bits != 4 or group > 16]


def on_panel(bits: int, rows: int) -> bool:
    """Whether the kernel multiplies `rows` rows of codes of `bits` (CODES) on a panel."""
    return bits != 4 and rows >= (SEVEN_BIT_PANEL_MIN_ROWS if bits == 7 else PANEL_MIN_ROWS)


# rows: the register tiles (4 rows, then 1-3); 8-bit codes on the panel from 8 (PANEL_MIN_ROWS), 7-bit ones from 24;
# 80 channels: five 16-blocks, the last on a one-vector tile; 256 columns: one group a row at group 256
@pytest.mark.parametrize("rows", [1, 2, 3, 6, PANEL_MIN_ROWS, 33])
@pytest.mark.parametrize("minimums", [True, False])
@pytest.mark.parametrize(("bits", "signed", "group"), LAYOUTS)
@needs_bf16_dot
def test_kernel_equals_dequantize_then_matmul(ops, rows, group, minimums, bits, signed):
    """The exact paths give the dequantized layer's outputs up to float32's rounding of the sums; a panel of grouped
    codes (whose groups the tiles would otherwise scale one by one) gives x @ the weight rounded to bf16, as the
    prompts' tiles and a bf16 model do."""
    g = torch.Generator().manual_seed(rows * group + bits)
    n, k = 80, 256
    x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 4).bfloat16()
    codes, stored = random_codes(bits, signed, n, k, g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).half().float()  # float16 holds them exactly
    mins = (-torch.rand(n, k // group, generator=g) * 0.1).half().float() if minimums else None
    got = ops.bf16_dot_linear(x, vnni_weight(ops, stored, bits, signed, scales, mins, group))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    weight = codes.double() * scales.double().repeat_interleave(group, 1)
    if mins is not None:
        weight += mins.double().repeat_interleave(group, 1)
    if on_panel(bits, rows) and group < k:
        rounded = (codes.float() * scales.repeat_interleave(group, 1)
                   + (mins.repeat_interleave(group, 1) if mins is not None else 0)).bfloat16().double()
        expected = x.double() @ rounded.T
        bound = 2**-8 * expected.abs() + 2**-20 * x.abs().double() @ rounded.abs().T
        assert ((got.double() - expected).abs() <= bound).all()
        assert not torch.equal(rounded, weight)  # the rounding is real: the case is not the exact one
        return
    expected = x.double() @ weight.T
    offsets = EXCESS[bits, signed] * scales.repeat_interleave(group, 1)
    assert ((got.double() - expected).abs() <= tolerance(x, weight, offsets, expected)).all()


# MXFP4's 4-bit codes index a table, which this kernel has not: the grouped kernel looks them up (test_gguf_native)
@pytest.mark.parametrize("kind", [k for k in gguf_blocks.SUPPORTED if gguf_blocks.BITS[k] == 4
                                  and k not in gguf_blocks.LEVELS])
@needs_bf16_dot
def test_bfloat16_4bit_layers_take_it_by_default(ops, kind):
    """RTN int4 and GGUF's affine 4-bit formats in bfloat16 go onto the kernel at load where the layout fits (N in
    16s, K in 32s), and give the dequantized layer's outputs at every row count; torch's layout (bf16_dot=False, or a
    shape that does not fit) stays as it was."""
    rows, cols = 80, 512
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05
    gguf = gguf_blocks.unpack(random_blocks(kind, rows, cols, seed=2), GGMLQuantizationType[kind], (rows, cols))
    for qw in (quantize_int4(w, 32), gguf):
        layer = QuantizedLinear(qw, None, torch.bfloat16, ops)
        torch_layout = QuantizedLinear(qw, None, torch.bfloat16, ops, bf16_dot=False)
        assert (layer.kernel, torch_layout.kernel) == ("bf16_dot", "int4")
        assert layer.weight_bytes <= torch_layout.weight_bytes  # the same 0.625 bytes a weight, less its padding
        weight = dequantize(qw).double()
        offsets = 128 * qw.scales.double().abs().reshape(rows, -1).repeat_interleave(qw.group_size, 1)
        for tokens in (1, 7, 40):
            x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)).bfloat16()
            expected = x.double() @ weight.T
            # float16 scales: Q4_K's d * sc and RTN's float32 scales move by up to 2^-11 of themselves
            float16_scales = 2**-11 * x.abs().double() @ weight.abs().T
            bound = tolerance(x, weight, offsets, expected) + float16_scales
            assert ((layer(x).double() - expected).abs() <= bound).all()
    assert QuantizedLinear(quantize_int4(w[:72], 32), None, torch.bfloat16, ops).kernel == "int4"  # not in 16s


@needs_bf16_dot
def test_bfloat16_8bit_layers_take_it_by_default(ops):
    """int8 per channel and GGUF's Q8_0, Q5_0, Q5_K and Q6_K (16-column groups) in bfloat16 go onto the kernel at
    load, the 5- and 6-bit codes as seven_bit; a shape that does not fit stays on the grouped kernel. Each gives the
    dequantized layer's outputs at every row count: full 8-bit codes on the kernel's nibbles below PANEL_MIN_ROWS
    rows and on its panel from there, 7-bit ones each a bf16 below SEVEN_BIT_PANEL_MIN_ROWS, all on the tiles from
    BF16_DOT_TILED_MIN_ROWS; a panel of grouped codes and the tiles hold the weight rounded to bf16."""
    rows, cols = 80, 512
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05
    gguf = {kind: gguf_blocks.unpack(random_blocks(kind, rows, cols, seed=2), GGMLQuantizationType[kind], (rows, cols))
            for kind in ("Q8_0", "Q5_0", "Q5_K", "Q6_K")}
    for qw in (quantize_int8(w), *gguf.values()):
        layer = QuantizedLinear(qw, None, torch.bfloat16, ops)
        assert layer.kernel == "bf16_dot" and layer.vnni.seven_bit == (qw.bits in (5, 6))
        weight = dequantize(qw).double()
        scales = qw.scales.double().abs().reshape(rows, -1).repeat_interleave(qw.group_size or cols, 1)
        for tokens in (1, PANEL_MIN_ROWS - 1, PANEL_MIN_ROWS, 33, BF16_DOT_TILED_MIN_ROWS - 1, BF16_DOT_TILED_MIN_ROWS):
            x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)).bfloat16()
            expected = x.double() @ weight.T
            # float16 scales: float32 ones move by up to 2^-11 of themselves; the tiles and a panel of grouped codes
            # round the weight to bf16
            rounds = tokens >= BF16_DOT_TILED_MIN_ROWS or (
                qw.group_size is not None and on_panel(7 if qw.bits in (5, 6) else 8, tokens))
            rounding = (2**-8 if rounds else 2**-11) * x.abs().double() @ weight.abs().T
            bound = tolerance(x, weight, 2304 * scales, expected) + rounding
            assert ((layer(x).double() - expected).abs() <= bound).all()
        x = torch.randn(BF16_DOT_TILED_MIN_ROWS, cols).bfloat16()
        assert torch.equal(layer(x), ops.vnni_tiled_linear(x, layer.vnni))
        assert torch.equal(layer(x[1:]), ops.bf16_dot_linear(x[1:], layer.vnni))
    assert QuantizedLinear(quantize_int8(w[:72]), None, torch.bfloat16, ops).kernel == "int8"  # not in 16s


@needs_bf16_dot
def test_a_tied_table_is_looked_up_from_the_heads_layout(ops):
    """A tied embedding table whose output projection holds pack_vnni's layout reads its rows from there, and
    keeps no copy of its own: the dequantized rows (exactly for Q8_0, whose scales float16 holds; to float16's
    rounding of RTN's float32 scales and minimums), bad rows refused by name."""
    rows, cols = 96, 256
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05
    q8_0 = gguf_blocks.unpack(random_blocks("Q8_0", rows, cols, seed=2), GGMLQuantizationType.Q8_0, (rows, cols))
    ids = torch.tensor([[0, 17, 95], [33, 64, 1]])
    for qw, exact in ((quantize_int8(w), False), (q8_0, True), (quantize_int4(w, 64), False)):
        head = QuantizedLinear(qw, None, torch.bfloat16, ops)
        table = QuantizedEmbedding(qw, torch.bfloat16, head)
        assert head.kernel == "bf16_dot" and table.weight_q is None
        expected = dequantize(qw)[ids.reshape(-1)].view(2, 3, cols)
        got = table(ids)
        assert got.dtype == torch.bfloat16
        bound = 2**-8 * expected.abs() + (0 if exact else 2**-10 * expected.abs().amax(-1, keepdim=True))
        assert ((got.float() - expected).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="row 96 out of"):
        table(torch.tensor([96]))


@needs_bf16_dot
def test_int8_activations_read_the_same_layout(ops):
    """A weight's layer with int8 activations holds the very bytes its bf16_dot layer holds: one layout, two
    kernels."""
    qw = quantize_int4(torch.randn(64, 128), 32)
    exact = QuantizedLinear(qw, None, torch.bfloat16, ops)
    integer = QuantizedLinear(qw, None, torch.bfloat16, ops, int8_activations=True)
    assert (exact.kernel, integer.kernel) == ("bf16_dot", "vnni") and torch.equal(integer.qweight, exact.qweight)
    x = torch.randn(3, 128).bfloat16()
    assert not torch.equal(integer(x), exact(x))  # the integer arithmetic really runs


@needs_bf16_dot
def test_a_row_gets_the_same_bits_in_any_batch(ops):
    """Each row's sums run in the same order whatever tile it lands in (4, 3, 2 or 1 rows; one or two channel
    blocks): a request's logits do not depend on what it is batched with (below BF16_DOT_TILED_MIN_ROWS rows,
    above decode's max_num_seqs). Full 8-bit codes change their arithmetic at PANEL_MIN_ROWS (two nibbles, then one
    exact bf16 value): from there on, the same bits in any batch."""
    w = torch.randn(80, 256, generator=torch.Generator().manual_seed(3))
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    q6_k = gguf_blocks.unpack(random_blocks("Q6_K", 80, 256, seed=5), GGMLQuantizationType.Q6_K, (80, 256))
    for qw in (quantize_int4(w, 64), quantize_int8(w), q6_k):
        layer = QuantizedLinear(qw, None, torch.bfloat16, ops)
        assert layer.kernel == "bf16_dot"
        batched, alone = layer(x), torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        assert torch.equal(layer(x[3:11]), batched[3:11])
        assert torch.equal(alone, batched) == (qw.bits != 8)


# 1040 channels at K = 2048: two of the 4 MiB tiles (1024 channels, then 16); 80 at K = 256: one tile of 5 blocks;
# 16-column groups for 8-bit codes only
TILED = [(1040, 2048, 32, True), (80, 256, 64, False), (80, 256, 128, True), (80, 256, 256, False), (80, 256, 16, True)]


@pytest.mark.parametrize(("n", "k", "group", "minimums", "bits", "signed"),
                         [(*shape, *codes) for shape in TILED for codes in CODES if codes[0] != 4 or shape[2] > 16])
@needs_bf16_dot
def test_prompt_tiles_equal_the_weight_rounded_to_bf16(ops, n, k, group, minimums, bits, signed):
    """vnni_tiled_linear dequantizes code * scale + minimum in float32 and rounds it to bf16 (as a bf16 model's
    weights are) before oneDNN multiplies: it equals x @ that weight, up to bf16's rounding of the output and
    float32's of the sums."""
    g = torch.Generator().manual_seed(n + group + bits)
    x = torch.randn(5, k, generator=g).bfloat16()
    codes, stored = random_codes(bits, signed, n, k, g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).half().float()
    mins = (-torch.rand(n, k // group, generator=g) * 0.1).half().float() if minimums else None
    vnni = vnni_weight(ops, stored, bits, signed, scales, mins, group)
    got = ops.vnni_tiled_linear(x, vnni)
    weight = codes.float() * scales.repeat_interleave(group, 1)
    if mins is not None:
        weight += mins.repeat_interleave(group, 1)
    rounded = weight.bfloat16().double()
    expected = x.double() @ rounded.T
    bound = 2**-8 * expected.abs() + 2**-20 * x.abs().double() @ rounded.abs().T
    assert got.dtype == torch.bfloat16 and ((got.double() - expected).abs() <= bound).all()
    # and the weight really is rounded: the exact kernel's sums differ somewhere
    assert not torch.equal(got, ops.bf16_dot_linear(x, vnni))


@needs_bf16_dot
def test_prompts_take_the_tiles_from_the_threshold_on(ops):
    layer = QuantizedLinear(quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(5)), 32),
                            None, torch.bfloat16, ops)
    x = torch.randn(BF16_DOT_TILED_MIN_ROWS, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(layer(x), ops.vnni_tiled_linear(x, layer.vnni))
    assert torch.equal(layer(x[1:]), ops.bf16_dot_linear(x[1:], layer.vnni))


def random_vnni(ops, n: int, k: int, group: int, minimums: bool, bits: int, signed: bool):
    """A random weight in pack_vnni's layout."""
    g = torch.Generator().manual_seed(n + group + bits)
    codes, stored = random_codes(bits, signed, n, k, g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01).half().float()
    mins = (-torch.rand(n, k // group, generator=g) * 0.1).half().float() if minimums else None
    return vnni_weight(ops, stored, bits, signed, scales, mins, group)


def tiles_weight(ops, vnni, k: int) -> torch.Tensor:
    """The bf16 weight [N, K] that vnni_tiled_linear multiplies by (test_prompt_tiles_equal_the_weight_rounded_to_bf16
    bounds it), read out exactly: an identity matrix's rows times it."""
    return ops.vnni_tiled_linear(torch.eye(k, dtype=torch.bfloat16), vnni).T.contiguous()


# channels in 64s (oneDNN's blocks): 1024 x 2048, 16 blocks; 192 x 256, 3
SCRATCH = [(1024, 2048, 32, True), (192, 256, 64, False), (192, 256, 256, True), (192, 256, 16, False)]


@pytest.mark.parametrize(("n", "k", "group", "minimums", "bits", "signed"),
                         [(*shape, *codes) for shape in SCRATCH for codes in CODES if codes[0] != 4 or shape[2] > 16])
@needs_bf16_dot
def test_prompt_scratch_holds_the_weight_as_onednn_packs_it(ops, n, k, group, minimums, bits, signed):
    """vnni_dequantize_onednn_ writes the plain tiles' bf16 weight into the scratch byte for byte as oneDNN's own
    packing of that weight lays it out (the scratch's earlier contents, the probe's, overwritten)."""
    vnni = random_vnni(ops, n, k, group, minimums, bits, signed)
    scratch = prompt_scratch(n, k, ops)
    assert scratch is not None  # oneDNN packs bf16 this way on AVX512-BF16 CPUs
    ops.vnni_dequantize_onednn_(scratch, vnni)
    onednn = torch.ops.mkldnn._reorder_linear_weight(tiles_weight(ops, vnni, k), 1)
    assert torch.equal(ops.onednn_bytes(scratch, 2 * n * k), ops.onednn_bytes(onednn, 2 * n * k))


@needs_bf16_dot
def test_prompts_multiply_on_the_shared_scratch(ops):
    """share_prompt_scratch gives layers of one shape one scratch, none to a shape outside oneDNN's 64-channel
    blocks; a prompt's rows then multiply by the plain tiles' bf16 weight, each layer by its own though the scratch
    is shared."""
    layers = nn.Sequential(*(QuantizedLinear(quantize_int4(torch.randn(n, 256, generator=torch.Generator().manual_seed(
        seed)), 32), None, torch.bfloat16, ops) for n, seed in ((192, 1), (192, 2), (128, 3), (80, 4))))
    assert share_prompt_scratch(layers, ops) == 2 * (192 + 128) * 256
    scratches = [layer.prompt_scratch for layer in layers]
    assert scratches[0] is scratches[1] and scratches[2] is not None and scratches[3] is None
    x = torch.randn(BF16_DOT_TILED_MIN_ROWS, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    for layer in (*layers, layers[0]):  # the first again, after the second has filled the scratch
        rounded = tiles_weight(ops, layer.vnni, 256).double()
        expected = x.double() @ rounded.T
        bound = 2**-8 * expected.abs() + 2**-20 * x.abs().double() @ rounded.abs().T
        assert ((layer(x).double() - expected).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="packed: a tensor of layout mkldnn"):
        ops.vnni_dequantize_onednn_(torch.empty(192, 256, dtype=torch.bfloat16), layers[0].vnni)
    with pytest.raises(RuntimeError, match="as many channels as the weight"):
        ops.vnni_dequantize_onednn_(scratches[2], layers[0].vnni)


def test_refusals_name_what_it_takes(ops):
    codes, scales = torch.randint(0, 16, (16, 64)), torch.rand(16, 2) * 0.01
    packed, unit = pack_vnni(codes, 4, scales, None, 32)
    weight = ops.VnniWeight(packed, 32, True, False, False, unit)
    with pytest.raises(RuntimeError, match="x: bfloat16"):
        ops.bf16_dot_linear(torch.randn(2, 64), weight)
    four_bit_sixteens, unit = pack_vnni(codes, 4, torch.rand(16, 4) * 0.01, None, 16)
    with pytest.raises(RuntimeError, match="4-bit codes: unsigned, in groups of 32s"):
        ops.bf16_dot_linear(torch.randn(2, 64).bfloat16(), ops.VnniWeight(four_bit_sixteens, 16, True, False,
                                                                          False, unit))
    with pytest.raises(RuntimeError, match="K: a multiple of 32"):
        ops.bf16_dot_linear(torch.randn(2, 48).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="seven_bit: 8-bit codes of at most 7 bits"):
        ops.bf16_dot_linear(torch.randn(2, 64).bfloat16(), ops.VnniWeight(packed, 32, True, False, False, unit, True))
    with pytest.raises(RuntimeError, match="x: bfloat16"):
        ops.vnni_tiled_linear(torch.randn(2, 64), weight)
    with pytest.raises(RuntimeError, match="4-bit codes: unsigned, in groups of 32s"):
        ops.vnni_tiled_linear(torch.randn(2, 64).bfloat16(), ops.VnniWeight(four_bit_sixteens, 16, True, False,
                                                                            False, unit))
