"""Attention backends behind one interface: `reference` (per sequence, plain) and `paged` (batched: ridge's C++
kernel on the CPU, Triton kernels on CUDA)."""

import torch

from ridge.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk
from ridge.attention.cuda import CudaBackend
from ridge.attention.paged import PagedBackend
from ridge.attention.reference import ReferenceBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"paged": PagedBackend, "reference": ReferenceBackend}


def backend_class(name: str, device: str | torch.device) -> type[AttentionBackend]:
    """The class that implements backend `name` on `device`."""
    if name == "paged" and torch.device(device).type == "cuda":
        return CudaBackend
    return BACKENDS[name]


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "CudaBackend", "PrefillChunk", "PagedBackend",
           "ReferenceBackend", "backend_class"]
