"""Attention backends behind one interface: `reference` (per sequence, plain) and `paged` (batched: ridge's C++
kernel on the CPU, Triton kernels on CUDA), and latent attention's own (`latent`, for MLA models)."""

import logging

import torch

from ridge.attention.backend import AttentionBackend, AttentionMetadata, PrefillChunk
from ridge.attention.cuda import CudaBackend, CudaQuantizedKVBackend
from ridge.attention.latent import LatentBackend
from ridge.attention.paged import PagedBackend
from ridge.attention.quantized_kv import QuantizedKVBackend
from ridge.attention.reference import ReferenceBackend
from ridge.config import ModelConfig
from ridge.kv.formats import KVFormat

log = logging.getLogger("ridge")

BACKENDS: dict[str, type[AttentionBackend]] = {"paged": PagedBackend, "reference": ReferenceBackend}


def backend_class(name: str, device: str | torch.device) -> type[AttentionBackend]:
    """The class that implements backend `name` on `device`."""
    if name == "paged" and torch.device(device).type == "cuda":
        return CudaBackend
    return BACKENDS[name]


def make_backend(cfg: ModelConfig, name: str, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device, kv_format: KVFormat | None = None,
                 num_slots: int = 0) -> AttentionBackend:
    """The backend that runs cfg's attention over num_blocks blocks: `name`'s; the reference one where the model
    caps its attention logits (the one backend that does); latent attention's own for MLA; the quantized cache's
    for a kv_format (EngineConfig has checked the device and name), with num_slots tails where the format keeps
    them."""
    args = (cfg.kv_layout(), cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, dtype, device)
    if kv_format is not None:
        cuda = torch.device(device).type == "cuda"
        for refused, what in ((cfg.is_mla, "latent attention (MLA)"),
                              (cuda and not cfg.uniform_attention,
                               "layers of different head widths or KV heads (Gemma 4) on CUDA yet"),
                              (cfg.attn_logit_softcap, "attention logit soft-capping (Gemma 2)")):
            if refused:
                raise ValueError(f"kv_cache_dtype: {kv_format.name} is not supported with {what}; use auto")
        quantized = CudaQuantizedKVBackend if cuda else QuantizedKVBackend
        return quantized(*args, scale=cfg.attention_scale, kv_format=kv_format,
                         num_tail_slots=num_slots if kv_format.tail else 0)
    if cfg.is_mla:  # one latent row a token, read as keys and values
        if name != "paged":
            log.warning("ridge: latent attention runs on its own backend (attention/latent.py), not %s", name)
        return LatentBackend(*args, scale=cfg.attention_scale, value_dim=cfg.kv_lora_rank,
                             index_dim=cfg.index_head_dim if cfg.index_topk else 0)
    if cfg.attn_logit_softcap and name != "reference":
        log.warning("ridge: attention logit soft-capping runs on the reference attention backend only (slow)")
        name = "reference"
    return backend_class(name, device)(*args, scale=cfg.attention_scale, softcap=cfg.attn_logit_softcap)


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "CudaBackend", "CudaQuantizedKVBackend",
           "LatentBackend", "PrefillChunk", "PagedBackend", "QuantizedKVBackend", "ReferenceBackend", "backend_class",
           "make_backend"]
