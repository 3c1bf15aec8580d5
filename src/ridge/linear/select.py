"""Which linear layer a weight gets: one decision, for (format, dtype, device, CPU features, options).

Every weight of a model goes through make_linear once, when it is loaded or quantized; nothing swaps a
layer afterwards. The row counts at which a chosen layer changes kernel are linear/rows.py's. A new device
is a new branch here and new layer classes beside these, not a branch in each layer: on CUDA, dense weights
stay torch's nn.Linear (cuBLAS) and quantized ones take linear/triton.py's layer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from ridge.linear.base import ConcatLinear
from ridge.linear.dense import FewRowsLinear, PackedLinear, onednn_packs, prompt_scratch
from ridge.linear.quantized import DequantizedLinear, Fp8Linear, GroupedInt8Linear, Int4Linear, Int8Linear
from ridge.linear.triton import TritonQuantLinear
from ridge.linear.vnni import Bf16DotLinear, VnniLinear, vnni_fits
from ridge.quant import mxfp4
from ridge.quant.rtn import QuantizedWeight, concatenate, with_codes_as_levels

log = logging.getLogger("ridge")


@dataclass(frozen=True)
class LinearTarget:
    """Where and how a model's linear layers run."""

    dtype: torch.dtype
    device: str = "cpu"
    ops: ModuleType | None = None  # ridge's CPU kernels, where they built (kernels/cpu_ops.py)
    packed: bool = True  # dense bf16 weights on oneDNN's packed layout, where oneDNN packs them
    int8_activations: bool = False  # quantized layers multiply int8-quantized inputs (EngineConfig's knob)
    batch_invariant: bool = False  # each row computed as alone (kernels/batch_invariance.py)
    bf16_dot: bool = True  # quantized weights on bf16 dot products where the CPU has them (off: torch's layouts)

    @property
    def cpu_ops(self) -> ModuleType | None:
        """ridge's kernels, when the layers run on the CPU."""
        return self.ops if self.device == "cpu" else None


def make_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                target: LinearTarget) -> nn.Module:
    """The layer that multiplies by `weight` on `target`: a dense weight (an nn.Parameter, kept without a
    copy where the kernel reads it as it is) or a quantized one."""
    if isinstance(weight, QuantizedWeight):
        return _quantized(weight, bias, target)
    kind = _dense_kind(target)
    if kind is PackedLinear:
        return PackedLinear(weight.data, bias, min_rows=2 if target.batch_invariant else 1)
    if kind is FewRowsLinear:
        return FewRowsLinear.wrap(weight, bias, target.cpu_ops, every_row=target.batch_invariant)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight, layer.bias = weight, bias
    return layer


def _dense_kind(target: LinearTarget) -> type[nn.Module]:
    if target.packed and onednn_packs(target.dtype, target.device):
        return PackedLinear
    # bf16 only where oneDNN cannot pack it (whatever `packed` says): elsewhere torch's bf16 matmul is oneDNN's
    bf16_unpackable = target.dtype == torch.bfloat16 and not onednn_packs(torch.bfloat16, target.device)
    if target.cpu_ops is not None and (target.dtype == torch.float32 or bf16_unpackable):
        return FewRowsLinear
    return nn.Linear  # torch's own


def _quantized(weight: QuantizedWeight, bias: torch.Tensor | None, target: LinearTarget) -> nn.Module:
    dtype, ops = target.dtype, target.cpu_ops
    if weight.levels is not None:  # 4-bit codes through a table (MXFP4): the kernels that read them as held
        if target.device.startswith("cuda"):
            # the Triton kernels' e2m1 codes: MXFP4's table, each half of a row's nibbles starting a block
            if torch.equal(weight.levels.cpu(), mxfp4.LEVELS) and weight.shape[1] % (2 * mxfp4.GROUP) == 0:
                return TritonQuantLinear(weight, bias, dtype, target.device)
            _warn_levels_widened(f"on {target.device}")
        elif ops is None:
            _warn_levels_widened(f"on {target.device}")
        elif target.int8_activations:
            _warn_levels_widened("with int8 activations")
        else:
            return GroupedInt8Linear(weight, bias, dtype, ops)
        weight = with_codes_as_levels(weight)
    if target.device.startswith("cuda"):
        return TritonQuantLinear(weight, bias, dtype, target.device)
    if weight.qweight.dtype == torch.float8_e4m3fn:
        return Fp8Linear(weight, bias, dtype)
    n, k = weight.shape
    if target.int8_activations and ops is not None and ops.vnni_available() and vnni_fits(weight):
        return VnniLinear(weight, bias, dtype, ops)
    if (target.bf16_dot and ops is not None and dtype == torch.bfloat16 and ops.bf16_dot_available()
            and Bf16DotLinear.fits(weight)):
        return Bf16DotLinear(weight, bias, dtype, ops)
    group = weight.group_size or k
    if ops is not None and ((dtype == torch.float32 and k % 16 == 0)
                            or (weight.bits != 4 and weight.group_size is not None)):  # GGUF Q5_0 / Q6_K / Q8_0
        # int8 activations on AVX2: float32 layers whose inputs quantize per 32 values
        avx2 = (target.int8_activations and dtype == torch.float32 and k % 32 == 0
                and (group == 16 or group % 32 == 0) and ops.int8_dot_available())
        return GroupedInt8Linear(weight, bias, dtype, ops, int8_activations=avx2)
    if target.device == "cpu" and weight.group_size is None:
        return Int8Linear(weight, bias, dtype, ops)
    if target.device == "cpu" and weight.bits == 4:
        return Int4Linear(weight, bias, dtype, ops)
    return DequantizedLinear(weight, bias, dtype)


@functools.cache
def _warn_levels_widened(where: str) -> None:
    log.warning("ridge: MXFP4's 4-bit codes have no table-lookup kernel %s: its layers hold them widened (the same "
                "numbers, more bytes to read)", where)


def fused_linear(parts: list[QuantizedWeight], bias: torch.Tensor | None, target: LinearTarget) -> nn.Module:
    """One layer over the stacked parts where their formats allow it, else a ConcatLinear of the runs that stack."""
    merged = concatenate(parts)
    if merged is not None:
        return make_linear(merged, bias, target)
    groups: list[list[QuantizedWeight]] = []
    for part in parts:  # consecutive parts that stack, stacked
        if groups and concatenate([*groups[-1], part]) is not None:
            groups[-1].append(part)
        else:
            groups.append([part])
    return ConcatLinear([make_linear(concatenate(g), None, target) for g in groups], bias)


def place_dense(model: nn.Module, target: LinearTarget) -> None:
    """Give each dense nn.Linear of the model's decoder layers, and its output projection, the layer
    make_linear picks (quantized layers were placed when they were made). Where that is torch's own
    nn.Linear, the model is left as it is."""
    if _dense_kind(target) is nn.Linear:
        return
    model.replace_linears(lambda weight, bias: make_linear(weight, bias, target))


def place_quantized(model: nn.Module, weights: Iterable[tuple[str, QuantizedWeight]], target: LinearTarget) -> None:
    """Give the model's decoder-layer linears and its output projection the layers of their quantized weights
    (keys as quant/methods.py's quantize_weights makes them: `layers.<i>.<module name>`, and `output_projection`),
    each as it comes."""
    for key, weight in weights:
        parent_path, _, name = key.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name, None)
        setattr(parent, name, make_linear(weight, getattr(old, "bias", None), target))


def int8_activation_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "int8_activations", False)]


def int8_activations_at_every_row(model: nn.Module) -> None:
    """Lift the AVX2 integer kernel's row limit: prompts on integers too (`ridge eval ppl --int8-activations`
    scores the arithmetic a decode step uses, at every row of its windows, as llama-perplexity does)."""
    for layer in model.modules():
        if isinstance(layer, GroupedInt8Linear) and layer.int8_activations:
            layer.int8_activation_max_rows = 1 << 62


def share_prompt_scratch(layers: nn.Module, ops: ModuleType) -> int:
    """Give each bf16-dot layer of the decoder layers a scratch in oneDNN's packed bf16 form, one per shape,
    shared by the layers of that shape (they run one at a time), into which its weight is dequantized at a
    prompt's rows (docs/notes/kernel-choices.md). The output projection is not among them: it sees a prompt's
    rows only where the prompt is scored, and its scratch would be the largest. Returns the scratch bytes."""
    scratches: dict[tuple[int, int], torch.Tensor | None] = {}
    for module in layers.modules():
        if isinstance(module, Bf16DotLinear):
            shape = (module.out_features, module.in_features)
            if shape not in scratches:
                scratches[shape] = prompt_scratch(*shape, ops)
            module.prompt_scratch = scratches[shape]
    return sum(2 * n * k for (n, k), scratch in scratches.items() if scratch is not None)
