"""The interface every linear layer of ridge's shares, and the fused projection built from several.

A layer is y = x @ W.T + bias for one weight format on one kernel: it knows its shape, the bytes a
forward pass streams for its weight (the roofline's numerator), and its form for the fused decode step
(kernels/decode_stack.py), or None where that step has no kernel for it. Which layer a weight gets is
decided once, by linear/select.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

NO_TENSOR = torch.empty(0)  # what a native part's unused tensor arguments get


class KernelLinear(nn.Module):
    """A linear layer on one kernel. Subclasses set `kernel` (its name in the decode stack and in reports)
    and implement multiply(); forward() handles the shape, the dtype and the bias once for all of them."""

    kernel: str = ""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias
        self.dtype = dtype

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] in self.dtype -> [rows, out], without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~120 times: skip the reshapes and casts that would be no-ops
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        out = self.multiply(rows)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass streams from memory for the weight (as held, padding aside)."""
        return sum(b.nbytes for b in self.buffers(recurse=False))

    def native_part(self, ops: ModuleType, bias: torch.Tensor | None) -> Any | None:
        """This layer as the decode stack's LinearPart with `bias`, or None where it has no kernel there."""
        return None


class ConcatLinear(nn.Module):
    """A fused projection (q|k|v, gate|up) whose parts come in different formats (a GGUF file may store v
    at more bits than q and k): each part on its own kernel, outputs side by side."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def weight_bytes(self) -> int:
        return sum(weight_bytes(p) for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


def weight_bytes(module: nn.Module) -> int:
    """The bytes a forward pass of a linear layer, of any kind, streams for its weight."""
    if hasattr(module, "weight_bytes"):
        return module.weight_bytes
    return module.weight.nbytes  # a plain nn.Linear


def model_weight_bytes(model: nn.Module, batch: int = 1) -> float:
    """Bytes of weights one decode step of `batch` sequences must read: every decoder layer plus the vocabulary
    projection, as held (quantized layers count their codes and scales). The embedding table is only gathered
    (one row per token), so a tied table counts once, as the head. A module that reads only part of its weights
    in a step (a mixture of experts) says how much with read_bytes(read, batch)."""

    def read(module: nn.Module) -> float:
        partial = getattr(module, "read_bytes", None)
        if partial is not None:
            return partial(read, batch)
        if isinstance(module, ConcatLinear):
            return sum(read(part) for part in module.parts)
        if hasattr(module, "weight_bytes") or isinstance(module, nn.Linear):
            return weight_bytes(module)
        return sum(p.nbytes for p in module.parameters(recurse=False)) + sum(read(c) for c in module.children())

    head = model.output_projection
    return read(model.layers) + (read(head) if head is not None else model.output_weight.nbytes)


def native_linear(ops: ModuleType, module: nn.Module) -> Any | None:
    """The decode stack's form of a projection (ops.Linear), or None where a part of it has no kernel there."""
    if isinstance(module, ConcatLinear):
        parts = [native_part(ops, p, None) for p in module.parts]
        return None if any(p is None for p in parts) else ops.Linear(parts, module.bias)
    part = native_part(ops, module, module.bias)
    return None if part is None else ops.Linear([part], None)


def native_part(ops: ModuleType, module: nn.Module, bias: torch.Tensor | None) -> Any | None:
    if type(module) is nn.Linear:  # torch's own, where no faster kernel was chosen
        return ops.LinearPart("linear", module.weight, NO_TENSOR, NO_TENSOR, 0, False, bias, 0)
    return module.native_part(ops, bias) if hasattr(module, "native_part") else None
