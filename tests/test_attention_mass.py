"""The attention mass per KV block that heavy-hitter eviction ranks blocks by (kv/eviction.py): what each
backend path adds (the decode kernels over bf16, float32, int8 and fp8 caches, the fused decode stack's calls,
torch without the kernels, prompt chunks' observed rows) against softmax probabilities computed here from the
cache's own keys."""

from __future__ import annotations

import pytest
import torch

from ridge.attention import AttentionMetadata, PagedBackend, PrefillChunk, QuantizedKVBackend
from ridge.kv.eviction import OBSERVED_ROWS
from ridge.kv.formats import kv_format

HEADS, KV_HEADS, D, BLOCK = 6, 2, 64, 16


def _expected(q: torch.Tensor, keys: torch.Tensor, visible: int, scale: float) -> torch.Tensor:
    """q [heads, d] over keys [kv_heads, L, d], the first `visible` of them -> per block, summed over heads."""
    group = q.shape[0] // keys.shape[0]
    k = keys[:, :visible].float().repeat_interleave(group, 0)  # [heads, visible, d]
    p = (torch.einsum("hd,hld->hl", q.float(), k) * scale).softmax(-1).sum(0)
    return torch.nn.functional.pad(p, (0, -visible % BLOCK)).view(-1, BLOCK).sum(-1)


def _backend(kind: str, ops) -> PagedBackend:
    num_blocks = 64
    if kind in ("int8", "fp8"):
        backend = QuantizedKVBackend(1, KV_HEADS, D, num_blocks, BLOCK, torch.float32, "cpu", kv_format=kv_format(kind))
    else:
        backend = PagedBackend(1, KV_HEADS, D, num_blocks, BLOCK, getattr(torch, kind), "cpu")
    backend.ops = ops
    return backend


@pytest.mark.threaded
@pytest.mark.parametrize("kind", ["bfloat16", "float32", "int8", "fp8"])
@pytest.mark.parametrize("kernels", [True, False])
def test_each_decode_path_adds_its_rows_attention_per_block(kind, kernels, ops):
    """Three decodes of 1 to 600 tokens (three kernel partitions) in scattered blocks: the mass each row adds to
    each block of its table is its softmax probabilities there summed over query heads, 1 a head in all."""
    torch.manual_seed(0)
    backend = _backend(kind, ops if kernels else None)
    lengths = [1, 45, 600]
    blocks = [-(-n // BLOCK) for n in lengths]
    tables = list(torch.randperm(64)[:sum(blocks)].split(blocks))
    for table, n in zip(tables, lengths, strict=True):
        pos = torch.arange(n)
        k, v = torch.randn(n, KV_HEADS, D) * 2, torch.randn(n, KV_HEADS, D)
        backend.write(0, k.to(backend.dtype), v.to(backend.dtype), table[pos // BLOCK] * BLOCK + pos % BLOCK)
    width = max(blocks)
    mass = torch.zeros(3, width + 2)  # wider than the tables, as a step's longest chunk may make it
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=3,
        decode_block_tables=torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in tables]),
        decode_context_lens=torch.tensor(lengths), prefills=[], attention_mass=mass)
    backend.prepare(meta)
    q = torch.randn(3, HEADS, D).to(backend.dtype)
    backend.attend(0, q, None, None, meta)
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        keys, _ = backend.gather(0, table)
        expected = _expected(q[i], keys, n, backend.scale)
        assert torch.allclose(mass[i, :len(table)], expected, atol=2e-5), (mass[i, :len(table)] - expected).abs().max()
        assert mass[i, len(table):].abs().max() == 0
        assert mass[i].sum() == pytest.approx(HEADS, abs=1e-4)


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
@pytest.mark.parametrize("cached", [0, 70])  # a prompt's first chunk (its own k, v), or one continuing a cache
def test_a_prompt_chunk_adds_its_last_rows_attention(kind, cached, ops):
    """A chunk of 50 tokens counts its last OBSERVED_ROWS queries only, each over what it sees (causal)."""
    torch.manual_seed(1)
    backend = _backend(kind, ops)
    n = 50
    total = cached + n
    table = torch.randperm(64)[:-(-total // BLOCK)]
    k = (torch.randn(total, KV_HEADS, D) * 2).to(backend.dtype)
    v = torch.randn(total, KV_HEADS, D).to(backend.dtype)
    pos = torch.arange(total)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    backend.write(0, k[:cached], v[:cached], slots[:cached])
    mass = torch.zeros(1, len(table))
    meta = AttentionMetadata(slot_mapping=slots[cached:], num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                             decode_context_lens=torch.zeros(0, dtype=torch.long),
                             prefills=[PrefillChunk(0, n, total, table)], attention_mass=mass)
    backend.prepare(meta)
    q = torch.randn(n, HEADS, D).to(backend.dtype)
    backend.forward(0, q, k[cached:], v[cached:], [meta])
    # keys as the chunk read them: its own rows whole (a first chunk), else the cache's
    keys = k.transpose(0, 1) if not cached else backend.gather(0, table)[0]
    expected = torch.zeros(len(table))
    for j in range(n - OBSERVED_ROWS, n):
        row = _expected(q[j], keys, cached + j + 1, backend.scale)
        expected[:len(row)] += row
    assert torch.allclose(mass[0], expected, atol=1e-4), (mass[0] - expected).abs().max()
    assert mass[0].sum() == pytest.approx(HEADS * OBSERVED_ROWS, abs=1e-3)
