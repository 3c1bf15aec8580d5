"""Triton kernels of the CUDA attention backend (attention/cuda.py): paged decode, prefill over a cached
context, and the cache write.

The cache of a layer is [num_blocks, block_size, kv_heads, head_dim] for K and for V: a token's K (or V)
for all heads is one contiguous row, so a write is one row store and a block's keys of one head are
block_size rows a fixed stride apart.

Decode is flash-decoding: one program per (row, KV head, split) reads one split of the row's context,
tile by tile, for all the query heads that share the KV head (GQA: the group is the tile's M dimension,
padded to 16 for tl.dot), with an online softmax; a second kernel merges the splits by their log-sum-exp.
A batch-1 step has kv_heads programs without splits, a few percent of an H100's 132 SMs: splitting the
context is what lets a small batch read its KV at the memory's speed. Every row divides its own context
(from its window's first key, with a window) into the step's number of splits, so a row of 100 tokens and
one of 100k both use all their programs, and the number of splits depends only on the batch's shape (a
CUDA graph captures it once). Products run on tensor cores in the cache's 16-bit type, accumulated in float32
(the probabilities rounded to that type for the second product, as flash attention does), and in IEEE float32
for float32 models.

Prefill chunks that continue a cached context run in one launch for all of them: a program per (32
queries of a chunk, query head) reads the chunk's context from its blocks in place, causal and windowed,
with the same online softmax; a fresh prompt goes to SDPA's flash kernel instead.

The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1), which is how the test suite
checks them against the torch reference without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE = 64  # keys per iteration of the decode loop: 4 blocks of 16, 128 B rows of bf16 at head_dim 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, starts_ptr, out_ptr, lse_ptr,
    scale, num_splits,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + row)
    first_key = tl.load(starts_ptr + row) if HAS_WINDOW else 0
    # this split's tiles, out of the row's live ones [first_key // TILE, ceil(context_len / TILE))
    live_from = first_key // TILE
    live_tiles = tl.cdiv(context_len, TILE) - live_from
    per_split = tl.cdiv(live_tiles, num_splits)
    tile_from = live_from + split * per_split
    tile_to = tl.minimum(tile_from + per_split, live_from + live_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if FLOAT32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_from, tile_to):
        keys = tile * TILE + tl.arange(0, TILE)
        visible = (keys < context_len) & (keys >= first_key)
        block = tl.load(tables_ptr + row * stride_tb + keys // BLOCK_SIZE, mask=keys < context_len, other=0)
        offsets = block * stride_kn + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = visible[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FLOAT32_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FLOAT32_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(out_ptr + row * stride_ob + split * stride_os + heads[:, None] * stride_oh + d[None, :], out,
             mask=q_mask)
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(
    parts_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(parts_ptr + row * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v,
                        ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:  # a negative slot is a CUDA graph's padding row: written nowhere
        i = tl.arange(0, BLOCK)
        k = tl.load(k_ptr + token * stride_k + i, mask=i < ROW)
        v = tl.load(v_ptr + token * stride_v + i, mask=i < ROW)
        tl.store(k_cache_ptr + slot * ROW + i, k, mask=i < ROW)
        tl.store(v_cache_ptr + slot * ROW + i, v, mask=i < ROW)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tile_chunks_ptr, tile_offsets_ptr,
    starts_ptr, lengths_ptr, context_lens_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kn, stride_kt, stride_kh, stride_ot, stride_oh, stride_tc,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.load(tile_chunks_ptr + tile)
    offset = tl.load(tile_offsets_ptr + tile)  # of the tile's first query in its chunk
    start = tl.load(starts_ptr + chunk)  # the chunk's first row in the step
    length = tl.load(lengths_ptr + chunk)
    context_len = tl.load(context_lens_ptr + chunk)
    i = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    q_in = offset + i < length
    positions = context_len - length + offset + i  # each query's position in its sequence
    q = tl.load(q_ptr + (start + offset + i)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=q_in[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    if FLOAT32_DOT:
        q = q.to(tl.float32)
    last_position = context_len - length + tl.minimum(offset + BLOCK_Q, length) - 1
    first_key = tl.maximum(context_len - length + offset - window + 1, 0) if HAS_WINDOW else 0
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for key_tile in range(first_key // TILE, last_position // TILE + 1):
        keys = key_tile * TILE + tl.arange(0, TILE)
        block = tl.load(tables_ptr + chunk * stride_tc + keys // BLOCK_SIZE, mask=keys < context_len, other=0)
        offsets = block * stride_kn + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = (keys < context_len)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FLOAT32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        visible = keys[None, :] <= positions[:, None]
        if HAS_WINDOW:
            visible &= keys[None, :] > positions[:, None] - window
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (start + offset + i)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_in[:, None] & (d < HEAD_DIM)[None, :])


def _float32_dot(dtype: torch.dtype) -> bool:
    """Products in float32: for float32 models, and under the interpreter, which has no 16-bit dot."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def num_splits(batch: int, kv_heads: int, max_keys: int, multiprocessors: int) -> int:
    """Splits per row that give the step about two programs per multiprocessor, no more than the widest
    row has tiles."""
    wanted = -(-2 * multiprocessors // (batch * kv_heads))
    return max(1, min(wanted, -(-max_keys // TILE), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window_starts: torch.Tensor | None,
                 splits: int) -> torch.Tensor:
    """q: [B, heads, d], one query per row at position context_len - 1; caches [N, block_size, kv_heads, d];
    block_tables [B, W]; context_lens [B] (at least 1); window_starts [B] or None -> [B, heads, d]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    parts = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, window_starts if window_starts is not None else context_lens,
        parts, lse, scale, splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=TILE, HAS_WINDOW=window_starts is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(q.dtype),
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(batch, heads)](
        parts, lse, out, splits, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)),
    )
    return out


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    """k, v: [T, kv_heads, d] -> cache slots [T] (slot = block * block_size + offset; negative: skipped)."""
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape[0] == 0:
        return
    # a token's heads are one contiguous row on both sides (k, v may be views into a fused qkv output)
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2] and k_cache.is_contiguous()
    _cache_write_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
                                       ROW=row, BLOCK=triton.next_power_of_2(row))


PREFILL_QUERIES = 32  # queries per program of the prefill kernel


def prefill_tiles(lengths: list[int]) -> tuple[list[int], list[int]]:
    """The prefill kernel's programs for chunks of these lengths: (chunk, first query) of each."""
    chunks, offsets = [], []
    for chunk, length in enumerate(lengths):
        for offset in range(0, length, PREFILL_QUERIES):
            chunks.append(chunk)
            offsets.append(offset)
    return chunks, offsets


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  tables: torch.Tensor, tile_chunks: torch.Tensor, tile_offsets: torch.Tensor, starts: torch.Tensor,
                  lengths: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None) -> None:
    """Prefill chunks that attend to their sequences' cached context (their own K/V already written): chunk c's
    queries are q rows starts[c] .. starts[c] + lengths[c] - 1, at positions context_lens[c] - lengths[c] on;
    its blocks are tables[c]. Writes those rows of `out` ([T, heads, d], like q). tile_chunks / tile_offsets:
    prefill_tiles' programs."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    _prefill_kernel[(tile_chunks.shape[0], heads)](
        q, k_cache, v_cache, out, tables, tile_chunks, tile_offsets, starts, lengths, context_lens,
        scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_Q=PREFILL_QUERIES, TILE=TILE, HAS_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(q.dtype),
    )
