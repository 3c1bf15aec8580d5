"""Attention backends behind one interface: `reference` (per sequence, plain) and `paged` (batched)."""

from ridge.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk
from ridge.attention.paged import PagedBackend
from ridge.attention.reference import ReferenceBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"paged": PagedBackend, "reference": ReferenceBackend}

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "PrefillChunk", "PagedBackend", "ReferenceBackend"]
