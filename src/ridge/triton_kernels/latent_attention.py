"""Triton decode of multi-head latent attention (attention/latent.py) over its paged cache, for CUDA.

A layer's cache is [num_blocks, block_size, dim], each token's row its latent (value_dim values) then its rotary
key; a query (absorbed: W_UK folded in) scores the whole row and sums the latent part. Every query head reads the
same row, so the kernel is paged_attention.py's flash-decoding with one KV head: a program per (row, group of
HEADS_PER_PROGRAM query heads, split) reads one split of the row's context, tile by tile, scoring the tile's
latents and rotary keys in two products and adding the weighted latents, with an online softmax; paged_attention's
merge kernel then combines the splits by their log-sum-exp. Heads go in groups of 16 (tl.dot's smallest M)
rather than all at once because the running sums hold [heads, value_dim] float32 values in registers: 16 x 512
of them at DeepSeek's rank. A model with more heads reads its rows once per group (from L2 after the first).

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1), which is how the test suite checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.triton_kernels.paged_attention import (
    STEP_SHAPED_SPLIT,
    _float32_dot,
    _softmax_step,
    _split_result,
    _split_tiles,
    merge_splits,
)

TILE = 32  # tokens per iteration: 32 rows of 576 bf16 values at DeepSeek's shapes, 36 KB a tile
HEADS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=STEP_SHAPED_SPLIT)
def _latent_split_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, starts_ptr, out_ptr, lse_ptr,
    scale, num_splits, heads,
    stride_qb, stride_qh, stride_cn, stride_ct, stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    VALUE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, FLOAT32_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + row)
    first_key = tl.load(starts_ptr + row) if HAS_WINDOW else 0
    tile_from, tile_to = _split_tiles(context_len, first_key, split, num_splits, TILE)

    h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    v = tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    h_in = h < heads
    queries = q_ptr + row * stride_qb + h[:, None] * stride_qh
    q_latent = tl.load(queries + v[None, :], mask=h_in[:, None] & (v < VALUE_DIM)[None, :], other=0.0)
    q_rope = tl.load(queries + VALUE_DIM + r[None, :], mask=h_in[:, None] & (r < ROPE_DIM)[None, :], other=0.0)
    if FLOAT32_DOT:
        q_latent, q_rope = q_latent.to(tl.float32), q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for tile in range(tile_from, tile_to):
        keys = tile * TILE + tl.arange(0, TILE)
        visible = (keys < context_len) & (keys >= first_key)
        block = tl.load(tables_ptr + row * stride_tb + keys // BLOCK_SIZE, mask=keys < context_len, other=0)
        rows = cache_ptr + block * stride_cn + (keys % BLOCK_SIZE) * stride_ct
        latents = tl.load(rows[:, None] + v[None, :], mask=visible[:, None] & (v < VALUE_DIM)[None, :], other=0.0)
        rope = tl.load(rows[:, None] + VALUE_DIM + r[None, :], mask=visible[:, None] & (r < ROPE_DIM)[None, :],
                       other=0.0)
        if FLOAT32_DOT:
            latents, rope = latents.to(tl.float32), rope.to(tl.float32)
        scores = tl.dot(q_latent, tl.trans(latents), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        scores = tl.where(visible[None, :], scores * scale, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(latents.dtype), latents, input_precision=PRECISION)
        m_i = m_new

    out, lse = _split_result(acc, m_i, l_i)
    tl.store(out_ptr + row * stride_ob + split * stride_os + h[:, None] * stride_oh + v[None, :], out,
             mask=h_in[:, None] & (v < VALUE_DIM)[None, :])
    tl.store(lse_ptr + row * stride_lb + h * stride_lh + split, lse, mask=h_in)


def num_splits(batch: int, heads: int, max_keys: int, multiprocessors: int) -> int:
    """Splits per row that give the step about two programs per multiprocessor, no more than the widest row has
    tiles."""
    programs = batch * triton.cdiv(heads, HEADS_PER_PROGRAM)
    return max(1, min(triton.cdiv(2 * multiprocessors, programs), triton.cdiv(max_keys, TILE), 64))


def latent_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float, value_dim: int, window_starts: torch.Tensor | None, splits: int) -> torch.Tensor:
    """q: [B, heads, dim], one query per row at position context_len - 1; cache [N, block_size, dim] (value_dim
    latent values, then the rotary key); block_tables [B, W]; context_lens [B] (at least 1); window_starts [B] or
    None -> [B, heads, value_dim]."""
    batch, heads, dim = q.shape
    block_size = cache.shape[1]
    assert cache.stride(2) == 1 and q.stride(2) == 1
    block_v = max(16, triton.next_power_of_2(value_dim))
    parts = torch.empty(batch, heads, splits, block_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _latent_split_kernel[(batch, triton.cdiv(heads, HEADS_PER_PROGRAM), splits)](
        q_ptr=q, cache_ptr=cache, tables_ptr=block_tables, lens_ptr=context_lens,
        starts_ptr=window_starts if window_starts is not None else context_lens,
        out_ptr=parts, lse_ptr=lse, scale=scale, num_splits=splits, heads=heads,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_cn=cache.stride(0), stride_ct=cache.stride(1),
        stride_tb=block_tables.stride(0),
        stride_ob=parts.stride(0), stride_oh=parts.stride(1), stride_os=parts.stride(2),
        stride_lb=lse.stride(0), stride_lh=lse.stride(1),
        VALUE_DIM=value_dim, BLOCK_V=block_v, ROPE_DIM=dim - value_dim,
        BLOCK_R=max(16, triton.next_power_of_2(dim - value_dim)), BLOCK_H=HEADS_PER_PROGRAM,
        BLOCK_SIZE=block_size, TILE=TILE, HAS_WINDOW=window_starts is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(q.dtype, None),
    )
    return merge_splits(parts, lse, q.new_empty(batch, heads, value_dim))


@triton.jit
def _write_rows_kernel(rows_ptr, cache_ptr, slots_ptr, stride_r, DIM: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:  # a negative slot is a CUDA graph's padding row: written nowhere
        i = tl.arange(0, BLOCK)
        tl.store(cache_ptr + slot * DIM + i, tl.load(rows_ptr + token * stride_r + i, mask=i < DIM), mask=i < DIM)


def write_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, dim] -> cache [N, block_size, dim] at slots [T] (slot = block * block_size + offset; negative:
    skipped)."""
    if rows.shape[0] == 0:
        return
    assert rows.stride(1) == 1 and cache.is_contiguous()
    dim = cache.shape[2]
    _write_rows_kernel[(rows.shape[0],)](rows, cache, slots, rows.stride(0), DIM=dim,
                                         BLOCK=triton.next_power_of_2(dim))
