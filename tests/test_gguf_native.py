"""GGUF block formats run natively: unpacking against gguf's own dequantization, each format's kernel against
dequantize-then-matmul, and whole models against their dequantized selves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from ridge.kernels import cpu_ops
from ridge.linear import KernelLinear, LinearTarget, make_linear
from ridge.linear.rows import BF16_DOT_TILED_MIN_ROWS, INT8_ACTIVATIONS_MAX_ROWS
from ridge.linear.select import int8_activations_at_every_row
from ridge.quant import gguf_blocks
from ridge.quant.rtn import dequantize

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core


def QuantizedLinear(weight, bias, dtype, ops, **options) -> torch.nn.Module:  # noqa: N802 - make_linear's pick
    return make_linear(weight, bias, LinearTarget(dtype, ops=ops, **options))


# where each format keeps its float16 block scales (d, and m or dmin), as llama.cpp lays the blocks out
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks for a [rows, cols] tensor: every byte random (any bit pattern is a valid code or sub-block
    scale), the float16 scales set to finite values of either sign."""
    qtype = GGMLQuantizationType[kind]
    values, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // values, nbytes), dtype=np.uint8)
    if kind == "MXFP4":  # its scale a power of two, 2^(e - 128): exponents of weights (not of infinities)
        blocks[:, 0] = rng.integers(100, 131, len(blocks), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(kind, ()):
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def cols_for(kind: str) -> int:
    return 512 if kind.endswith("_K") else 96  # K-quants come in 256-value super-blocks


@pytest.mark.parametrize("kind", gguf_blocks.SUPPORTED)
def test_unpacked_codes_and_scales_equal_gguf_dequantize(kind):
    rows, cols = 37, cols_for(kind)
    blocks = random_blocks(kind, rows, cols, seed=len(kind))
    qw = gguf_blocks.unpack(blocks, GGMLQuantizationType[kind], (rows, cols))
    expected = gguf_dequantize(blocks, GGMLQuantizationType[kind]).reshape(rows, cols)
    assert qw.bits == gguf_blocks.BITS[kind] and qw.group_size == gguf_blocks.GROUP_SIZES[kind]
    low, high = (0, 15) if qw.bits == 4 else (-128, 127)
    assert low <= int(qw.qweight.min()) and int(qw.qweight.max()) <= high
    # float32 rounding of w = code * scale + minimum only
    assert np.abs(dequantize(qw).numpy() - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize("kind", [*gguf_blocks.SUPPORTED, "F16"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpp"])
def test_dequantize_gives_gguf_s_values_to_the_bit(kind, kernels, request):
    """The loader's dequantize (ridge's bit-unpacking, in torch ops or in one C++ pass; F16 passed on to gguf)
    against gguf's numpy."""
    rows, cols = 37, cols_for(kind)
    if kind == "F16":
        blocks = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    else:
        blocks = random_blocks(kind, rows, cols, seed=len(kind))
    ops = request.getfixturevalue("ops") if kernels else None
    ours = gguf_blocks.dequantize(blocks, GGMLQuantizationType[kind], (rows, cols), ops)
    expected = gguf_dequantize(blocks, GGMLQuantizationType[kind]).reshape(rows, cols)
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", gguf_blocks.SUPPORTED)
# the register path (row blocks of 4, 3, 2, 1) up to 8 rows, 32 in float32; dequantized tiles beyond
@pytest.mark.parametrize("tokens", [1, 3, 6, 9, 40])
def test_native_kernel_equals_dequantize_then_matmul(ops, kind, dtype, tokens):
    rows, cols = 67, cols_for(kind)
    qw = gguf_blocks.unpack(random_blocks(kind, rows, cols, seed=tokens), GGMLQuantizationType[kind], (rows, cols))
    layer = QuantizedLinear(qw, None, dtype, ops)
    # MXFP4's 4-bit codes index a table: ridge's grouped kernel looks them up (torch's int4 kernel is affine)
    assert layer.kernel == ("int4" if qw.bits == 4 and qw.levels is None and dtype == torch.bfloat16
                            else "grouped_int8")
    if layer.kernel == "grouped_int8":  # 4-bit codes two a byte, the others a byte each
        assert layer.qweight.nbytes == rows * cols // (2 if qw.bits == 4 else 1)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    expected = x.float() @ dequantize(qw).T
    got = layer(x).float()
    # float32: summation order only; bf16: activations (and the int4 kernel's scales) carry 8 bits of mantissa
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def int8_activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kernels/int8_dot_linear.cpp's bound on |y - x @ w.T|: each x moves by at most half its 32-block's step
    (max |x| / 127 / 2), so the error is at most sum_b max_b |x| / 254 * sum_b |w|."""
    m, k = x.shape
    amax = x.abs().view(m, k // 32, 32).amax(-1).double()
    wabs = w.abs().view(w.shape[0], k // 32, 32).sum(-1).double()
    return amax / 254 @ wabs.T


@pytest.mark.parametrize("kind", gguf_blocks.SUPPORTED)
@pytest.mark.parametrize("tokens", [1, 3, 6, 32])
def test_int8_activation_kernel_within_its_bound(ops, kind, tokens):
    """Signed and unsigned codes, 16-column groups (Q6_K), minimums, odd channel counts: within the bound the
    kernel states (plus float32 rounding), and not the exact result (the integer path really ran)."""
    rows, cols = 67, cols_for(kind)
    qw = gguf_blocks.unpack(random_blocks(kind, rows, cols, seed=tokens), GGMLQuantizationType[kind], (rows, cols))
    layer = QuantizedLinear(qw, None, torch.float32, ops, int8_activations=True)
    assert layer.int8_activations
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    w = dequantize(qw)
    expected = x.double() @ w.double().T
    error = (layer(x).double() - expected).abs()
    assert (error <= int8_activation_bound(x, w) + 1e-5 * expected.abs().max()).all()
    assert error.max() > 1e-4 * expected.abs().max()


def test_int8_activations_leave_many_rows_to_the_exact_kernel(ops):
    """Past INT8_ACTIVATIONS_MAX_ROWS rows (a prompt) the exact kernel is the faster: the same bits as a layer
    without int8 activations; at that many rows and fewer, the integer kernel's numbers. `ridge eval ppl
    --int8-activations` lifts the limit, to measure the integer arithmetic on its windows."""
    qw = gguf_blocks.unpack(random_blocks("Q4_1", 40, 64, seed=0), GGMLQuantizationType.Q4_1, (40, 64))
    exact = QuantizedLinear(qw, None, torch.float32, ops)
    integer = QuantizedLinear(qw, None, torch.float32, ops, int8_activations=True)
    assert integer.kernel == "grouped_int8" and integer.int8_activations  # 40 channels: not VNNI's layout
    x = torch.randn(INT8_ACTIVATIONS_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(integer(x), exact(x))
    assert not torch.equal(integer(x[:-1]), exact(x[:-1]))
    int8_activations_at_every_row(integer)
    assert not torch.equal(integer(x), exact(x))


def test_unsupported_type_names_the_supported_ones():
    blocks = np.zeros((4, GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk.0.ffn_up.weight: GGUF type Q2_K has no native kernel.*Q4_0, Q4_1"):
        gguf_blocks.unpack(blocks, GGMLQuantizationType.Q2_K, (4, 256), "blk.0.ffn_up.weight")


def test_smollm2_native_matches_its_dequantized_weights(make_llm_for_test, smollm2_path, smollm2, ops):
    """In float32 every layer on ridge's grouped kernel (Q4_1 codes two a byte: torch's int4 kernel is 7x
    slower than a dense matmul in float32), the tied Q8_0 embedding table shared with the lookup: float32
    logits equal the dequantized model's, and the weights stay within 1.2x the file (measured 1.16x: float32
    scales and minimums where the file has float16 ones); in bfloat16 the Q4_1 layers go onto the exact bf16
    dot-product kernel where the CPU has AVX512-BF16, and so does the tied Q8_0 head (the lookup then reads its
    rows from the head's layout: one copy of the table), else onto torch's packed layout and the grouped kernel."""
    native = make_llm_for_test(smollm2_path, dtype="float32", quantization="gguf")
    plain = smollm2  # the session's float32 engine over the dequantized file
    ids = native.tokenizer.encode("The capital of France is a city that")
    got, expected = native.engine.prompt_logits(ids), plain.engine.prompt_logits(ids)
    assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert torch.equal(got[-1].argmax(), expected[-1].argmax())
    kernels = {m.kernel for m in native.engine.loaded.model.modules() if isinstance(m, KernelLinear)}
    assert kernels == {"grouped_int8"}
    assert _weight_bytes(native) <= 1.2 * smollm2_path.stat().st_size
    packed = make_llm_for_test(smollm2_path, dtype="bfloat16", quantization="gguf")
    kernels = {m.kernel for m in packed.engine.loaded.model.modules() if isinstance(m, KernelLinear)}
    assert kernels == ({"bf16_dot"} if ops.bf16_dot_available() else {"int4", "grouped_int8"})
    assert _weight_bytes(packed) <= 1.25 * smollm2_path.stat().st_size


def test_qwen_native_bfloat16_stays_near_the_dequantized_model(make_llm_for_test, qwen_path, qwen_float32, ops):
    """Qwen2.5-Coder's Q4_K_M file holds Q4_K, Q5_0, Q6_K and Q8_0 tensors: in bfloat16 each stays packed, on the
    exact bf16 dot-product kernel where the CPU has AVX512-BF16 (the 5- and 6-bit codes each one bf16, seven_bit), and
    the next-token distributions stay within bfloat16 activations' reach of the float32 dequantized model's
    (measured: KL 0.0006 nats on average, 0.0008 for the file dequantized to bfloat16, every argmax the same; a wrong
    excess, scale or group gives nats)."""
    native = make_llm_for_test(qwen_path, dtype="bfloat16", quantization="gguf")
    layers = [m for m in native.engine.loaded.model.modules() if isinstance(m, KernelLinear)]
    if ops.bf16_dot_available():
        assert {m.kernel for m in layers} == {"bf16_dot"}
        assert {m.bits for m in layers if m.vnni.seven_bit} == {5, 6}  # Q5_0 and Q6_K, not Q4_K or Q8_0
    plain = qwen_float32
    ids = plain.tokenizer.encode("def quicksort(items):\n    # sort a list in place, smallest first\n")
    exact = plain.engine.prompt_logits(ids).log_softmax(-1)
    got = native.engine.prompt_logits(ids).float().log_softmax(-1)
    kl = (exact.exp() * (exact - got)).sum(-1)
    assert kl.mean() < 0.01
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


class CountingOps:
    """ridge's kernels, counting the calls that dequantize into a prompt scratch."""

    def __init__(self, ops) -> None:
        self.ops, self.scratch_fills = ops, 0

    def vnni_dequantize_onednn_(self, *args):
        self.scratch_fills += 1
        return self.ops.vnni_dequantize_onednn_(*args)

    def __getattr__(self, name: str):
        return getattr(self.ops, name)


@pytest.mark.skipif("avx512_bf16" not in cpu_ops.cpu_flags(), reason="no AVX512-BF16: the layers are not bf16_dot")
def test_a_long_prompt_multiplies_on_the_packed_scratch(make_llm_for_test, smollm2_path, ops):
    """A prompt of BF16_DOT_TILED_MIN_ROWS tokens or more runs every decoder layer's linears on its weight
    dequantized into oneDNN's packed layout (share_prompt_scratch), one scratch fill a linear; its logits equal those
    through the plain tiles to bfloat16's rounding, every argmax the same (measured: identical)."""
    llm = make_llm_for_test(smollm2_path, dtype="bfloat16", quantization="gguf")
    linears = [m for m in llm.engine.loaded.model.layers.modules() if isinstance(m, KernelLinear)]
    assert linears and all(m.prompt_scratch is not None for m in linears)
    assert llm.engine.loaded.model.output_projection.prompt_scratch is None
    counting = CountingOps(ops)
    for m in linears:
        m.ops = counting
    ids = (llm.tokenizer.encode("Now is the winter of our discontent made glorious summer by this sun of York. ")
           * 40)[:BF16_DOT_TILED_MIN_ROWS + 20]
    packed = llm.engine.prompt_logits(ids).float()
    assert counting.scratch_fills == len(linears)
    for m in linears:
        m.prompt_scratch = None
    tiles = llm.engine.prompt_logits(ids).float()
    assert counting.scratch_fills == len(linears)
    assert (packed - tiles).abs().max() <= 2**-6 * tiles.abs().max()
    assert torch.equal(packed.argmax(-1), tiles.argmax(-1))


def test_smollm2_int8_activations_stay_near_the_exact_model(make_llm_for_test, smollm2_path, smollm2):
    """llama.cpp's arithmetic on the whole model: every quantized layer on the integer kernel, next-token
    distributions within a small KL divergence of the exact model's on average (measured 0.02-0.05 nats over
    three prompts, up to 0.4 at a single position: each layer's output is ~2% off on SmolLM2's outlier-heavy
    activations; a wrong scale, sign or lane order gives nats). A model with no quantized layer refuses the
    option, naming it."""
    fast = make_llm_for_test(smollm2_path, dtype="float32", quantization="gguf", int8_activations=True)
    layers = [m for m in fast.engine.loaded.model.modules() if isinstance(m, KernelLinear)]
    assert layers and all(m.int8_activations for m in layers)
    plain = smollm2
    ids = plain.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")
    exact, got = plain.engine.prompt_logits(ids).log_softmax(-1), fast.engine.prompt_logits(ids).log_softmax(-1)
    kl = (exact.exp() * (exact - got)).sum(-1)
    assert kl.mean() < 0.1
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75
    with pytest.raises(ValueError, match="int8_activations: needs quantized weights"):
        make_llm_for_test(smollm2_path, dtype="float32", int8_activations=True)


def _weight_bytes(llm) -> int:
    model = llm.engine.loaded.model
    table = model.embed_tokens.weight_q  # None where the lookup reads the tied head's layout
    tensors = [*model.parameters(), *model.buffers(), *(vars(table).values() if table is not None else ())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(storages.values())  # the lookup shares the head's codes


def test_tiled_kernel_runs_under_inference_mode(ops):
    """The many-row path writes the output from OpenMP worker threads, which must carry the caller's
    inference mode (the engine runs in it; a batch of 32 sequences reaches the Q8_0 head as 32 rows)."""
    qw = gguf_blocks.unpack(random_blocks("Q8_0", 67, cols_for("Q8_0"), seed=3), GGMLQuantizationType["Q8_0"],
                            (67, cols_for("Q8_0")))
    layer = QuantizedLinear(qw, None, torch.bfloat16, ops)
    x = torch.randn(40, cols_for("Q8_0"), dtype=torch.bfloat16)
    with torch.inference_mode():
        got = layer(x).float()
    expected = x.float() @ dequantize(qw).T
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
