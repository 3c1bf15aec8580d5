"""float32 linear layers whose few-row calls (decode) run on ridge's kernel (kernels/dense_linear.cpp).

torch's float32 linear at decode's shapes is MKL's sgemv on one thread; on the 2-core AVX2 box the
kernel, on both threads, ran 2.0-3.4x faster at one row and still 1.05-1.9x at 32 (docs/benchmarks.md).
Past FEW_ROWS rows (prefill) torch's sgemm takes over, unless the engine is batch invariant: sgemm's result
for a row changes with the number of rows beside it (kernels/batch_invariance.py), so there every call runs on
the kernel, FEW_ROWS rows at a time.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ridge.models.transformer import DecoderModel

FEW_ROWS = 32


class FewRowsLinear(nn.Linear):
    """An nn.Linear (same parameters, same results up to summation order) with a faster few-row path."""

    ops: ModuleType
    every_row: bool  # every call on the kernel, FEW_ROWS rows at a time (batch invariance)

    @classmethod
    def wrap(cls, weight: nn.Parameter, bias: nn.Parameter | None, ops: ModuleType,
             every_row: bool = False) -> FewRowsLinear:
        """Around existing parameters, without a copy (a tied output projection shares the embeddings')."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight, layer.bias, layer.ops, layer.every_row = weight, bias, ops, every_row
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.shape[0] <= FEW_ROWS:
            out = self.ops.dense_linear(rows, self.weight, self.bias)
        elif self.every_row:
            out = torch.cat([self.ops.dense_linear(tile, self.weight, self.bias) for tile in rows.split(FEW_ROWS)])
        else:
            return F.linear(x, self.weight, self.bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


def use_kernel(model: DecoderModel, ops: ModuleType, every_row: bool = False) -> DecoderModel:
    """Swap every nn.Linear of a float32 model's decoder layers, and its output projection, in place
    (quantized and packed layers are left as they are)."""
    model.replace_linears(lambda weight, bias: FewRowsLinear.wrap(weight, bias, ops, every_row))
    return model
