"""The C++ decode stack (kernels/decode_stack.py) against the Python path it replaces: the same kernels in the
same order, so the same bits; and the steps it leaves to the Python path."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from ridge import SamplingParams
from ridge.attention.backend import AttentionMetadata, KernelRows, PrefillChunk
from ridge.attention.cascade import SharedPrefix
from ridge.kernels import decode_stack
from ridge.kv.state_cache import StateStep
from ridge.linear import FewRowsLinear, LinearTarget, PackedLinear, fused_linear, make_linear, native_linear
from ridge.linear.dense import onednn_packs
from ridge.linear.rows import TILED_MIN_ROWS
from ridge.quant.rtn import quantize_fp8, quantize_int4, quantize_int8

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core


def layer(weight, bias, dtype, ops, **options) -> torch.nn.Module:
    return make_linear(weight, bias, LinearTarget(dtype, ops=ops, **options))


def projections(ops) -> dict[str, torch.nn.Module]:
    """Each projection form the stack takes, with a bias where the form can carry one."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g)
    bias = torch.randn(80, generator=g)
    exact = layer(quantize_int4(w, 32), bias, torch.float32, ops)
    integer = layer(quantize_int4(w, 32), bias, torch.float32, ops, int8_activations=True)
    assert integer.int8_activations  # AVX512-VNNI's matrix kernel where the CPU has it
    avx2 = layer(quantize_int4(w[:72], 32), bias[:72], torch.float32, ops, int8_activations=True)
    assert avx2.int8_activations and avx2.kernel == "grouped_int8"  # 72 channels: not in 16s
    # a 4-bit part beside an 8-bit one do not stack (a GGUF file's q|k in Q4_K, v in Q6_K): a ConcatLinear
    mixed = fused_linear([quantize_int4(w[:48], 32), quantize_int8(w[48:])], bias, LinearTarget(torch.float32, ops=ops))
    assert len(mixed.parts) == 2
    return {"dense": FewRowsLinear.wrap(torch.nn.Parameter(w), torch.nn.Parameter(bias), ops), "int4": exact,
            "int4+a8": integer, "int4+a8 avx2": avx2, "int4|int8": mixed}


def bf16_projections(ops) -> dict[str, torch.nn.Module]:
    """The bfloat16 forms: torch's int4 layout (72 channels, padded to 80 in it), int8 per channel on ridge's
    kernel, a plain and (where oneDNN packs bf16) a packed dense weight; where the CPU has AVX512-BF16, int4 on
    the exact bf16 dot-product kernel; where it has AVX512-VNNI, int4 and int8 on its integer matrix kernel."""
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(72, 96, generator=g), torch.randn(72, generator=g).bfloat16()
    int4 = layer(quantize_int4(w, 32), bias, torch.bfloat16, ops, bf16_dot=False)
    int8 = layer(quantize_int8(w), bias, torch.bfloat16, ops)
    assert (int4.kernel, int8.kernel) == ("int4", "int8") and int4.qweight.numel() * 2 > w.numel()
    linear = torch.nn.Linear(96, 72).bfloat16()
    forms = {"int4": int4, "int8": int8, "linear": linear}
    if onednn_packs(torch.bfloat16, "cpu"):
        forms["onednn"] = PackedLinear(linear.weight.data, linear.bias)
    if ops.bf16_dot_available():
        forms["int4 bf16_dot"] = layer(quantize_int4(w[:64], 32), bias[:64], torch.bfloat16, ops)
        assert forms["int4 bf16_dot"].kernel == "bf16_dot"
    if ops.vnni_available():
        for name, qw in (("int4+a8", quantize_int4(w[:64], 32)), ("int8+a8", quantize_int8(w[:64]))):
            forms[name] = layer(qw, bias[:64], torch.bfloat16, ops, int8_activations=True)
            assert forms[name].kernel == "vnni"
    return forms


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_projections_equal_their_modules(ops, rows):
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        for name, module in projections(ops).items():
            assert torch.equal(native_linear(ops, module)(x), module(x)), name
        for name, module in bf16_projections(ops).items():
            if rows < TILED_MIN_ROWS or name != "int4":  # torch's int4 layout changes kernel there
                assert torch.equal(native_linear(ops, module)(x.bfloat16()), module(x.bfloat16())), name


def test_a_projection_without_a_kernel_there_leaves_the_model_to_python(ops):
    fp8 = layer(quantize_fp8(torch.randn(32, 64)), None, torch.float32, ops)
    assert fp8.kernel == "fp8"
    assert native_linear(ops, fp8) is None


def test_serves_only_plain_decode_steps():
    def meta(decodes: int, tokens: int | None = None, prefills=(), rows=None, prefixes=()) -> AttentionMetadata:
        tables, lens = torch.zeros(decodes, 2, dtype=torch.long), torch.full((decodes,), 5)
        m = AttentionMetadata(torch.arange(tokens or decodes), decodes, tables, lens, list(prefills))
        m.kernel_rows = KernelRows(rows, tables, lens, list(prefixes))
        return m

    def serves(*groups: AttentionMetadata, max_rows: int = decode_stack.MAX_ROWS, states=None) -> bool:
        """groups: a KV group's each; states: a model with state-space layers' StateStep"""
        return decode_stack.DecodeStack(None, max_rows, state_space=states is not None).serves(groups, states)

    def states(decodes: int, chunks=()) -> StateStep:
        return StateStep(None, torch.arange(decodes + len(chunks)), decodes, list(chunks))

    assert serves(meta(1)) and serves(meta(decode_stack.MAX_ROWS)) and serves(meta(2), meta(2))
    assert not serves(meta(decode_stack.MAX_ROWS + 1))  # past the dense layers' few-row kernel
    assert not serves(meta(TILED_MIN_ROWS), max_rows=TILED_MIN_ROWS - 1)  # bf16's limit
    assert not serves(meta(2), meta(2, rows=torch.tensor([1, 0])))  # every group's rows must be plain
    assert not serves(meta(1, prefills=[PrefillChunk(1, 3, 3, torch.zeros(1, dtype=torch.long))]))
    assert not serves(meta(2, tokens=5))  # drafts scored: more tokens than sequences
    assert not serves(meta(2, rows=torch.tensor([1, 0])))
    assert not serves(meta(2, prefixes=[SharedPrefix(torch.tensor([0]), torch.tensor([0, 1]))]))
    # state-space layers (a pure Mamba-2 has no KV group): decodes only, no prefill chunk of any sequence
    assert serves(states=states(2)) and serves(meta(2), states=states(2))
    assert not serves(states=states(1, chunks=[(1, 4)])) and not serves(states=states(decode_stack.MAX_ROWS + 1))


@pytest.mark.parametrize("args", [{}, {"quantization": "gguf", "int8_activations": True}, {"kv_cache_dtype": "int8"},
                                  {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int4"}],
                         ids=["float32", "gguf+a8", "kv-int8", "kv-fp8", "kv-int4"])
def test_smollm2_stack_equals_the_python_path(make_llm_for_test, smollm2_path, args):
    """The same tokens and the same log-probabilities to the last bit, a batch of 6 at different lengths
    (bfloat16: tests/test_models_random.py, on models small enough for CPUs that emulate bf16 matmuls)."""
    if "kv_cache_dtype" in args and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("the stack reads a quantized cache through the AVX512 kernel only (elsewhere it stays off)")
    stacked = make_llm_for_test(smollm2_path, dtype="float32", **args)
    eager = make_llm_for_test(smollm2_path, dtype="float32", enforce_eager=True, **args)
    assert stacked.engine.runner.decode_stack is not None and eager.engine.runner.decode_stack is None
    prompts = random_prompts(6, stacked.engine.loaded.config.vocab_size, 3, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_the_stack_is_off_where_its_kernels_do_not_serve(make_llm_for_test, smollm2_path):
    reference = make_llm_for_test(smollm2_path, dtype="float32", attention_backend="reference")
    assert reference.engine.runner.decode_stack is None
    no_kernels = make_llm_for_test(smollm2_path, dtype="float32", cpu_kernels=False)
    assert no_kernels.engine.runner.decode_stack is None
    fp8 = make_llm_for_test(smollm2_path, dtype="float32", quantization="fp8", calibration_windows=0)
    assert fp8.engine.runner.decode_stack is None
