"""Token embeddings looked up from quantized codes (a GGUF file's table kept as its blocks)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ridge.linear.vnni import VnniLayoutLinear
from ridge.quant.rtn import QuantizedWeight, dequantize


class QuantizedEmbedding(nn.Module):
    """A lookup reads a row per token, so it dequantizes those rows and nothing else. A tied output projection
    shares the codes: where it holds them in pack_vnni's layout (its own copy), the rows are read from that
    layout (kernels/quant_linear.cpp's vnni_rows, the layout's float16 scales) and `weight` is not kept."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: nn.Module | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        vnni = isinstance(tied, VnniLayoutLinear)
        # the tied layer's weight and kernels, not the layer: a submodule would be the head twice in the model
        self.tied = (tied.vnni, tied.ops, tied.in_features) if vnni else None
        self.weight_q = None if vnni else weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.tied is not None:
            vnni, ops, k = self.tied
            return ops.vnni_rows(vnni, flat, k).to(self.dtype).view(*ids.shape, -1)
        w = self.weight_q
        # index_select, not w.qweight[flat]: advanced indexing cost ~30 us a tensor, three per decode step
        rows = dataclasses.replace(w, qweight=w.qweight.index_select(0, flat), scales=w.scales.index_select(0, flat),
                                   minimums=None if w.minimums is None else w.minimums.index_select(0, flat))
        return dequantize(rows).to(self.dtype).view(*ids.shape, -1)
