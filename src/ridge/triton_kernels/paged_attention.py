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

Both attention kernels also read a quantized cache (`--kv-cache-dtype fp8|int8|int4`, kv/formats.py) in
attention/quantized_kv.py's rows layout, codes [kv_heads, num_blocks, block_size, code bytes] with their scales,
widening each tile's codes to float32 in registers (fp8's from their bits, so that no fp8 type is needed) and
multiplying by the scales as they are read; the products then run in tf32. Keys are stored less their center,
which moves every score of a query by the same amount and so leaves attention as it is: nothing adds it back.

The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1), which is how the test suite
checks them against the torch reference without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from ridge.kv.formats import CHANNEL_SCALE_TABLE, KVFormat
from ridge.kv.layout import Window

TILE = 64  # keys per iteration of the decode loop: 4 blocks of 16, 128 B rows of bf16 at head_dim 64
MERGED_SPLITS = 16  # splits the merge kernel reads at a time
# Triton compiles a kernel again for each new pattern of its integer arguments (equal to 1, a multiple of 16, other):
# arguments that change from step to step (the splits, a table's width, the strides they set) are left out of that,
# or a step of a new shape stalls serving for a compile (checked by tests/test_triton_compile.py)
STEP_SHAPED_SPLIT = ["num_splits", "stride_tb", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]

# what a cache holds, as the kernels' FORMAT: values in the model's dtype, or codes of kv/formats.py's formats
PLAIN: tl.constexpr = tl.constexpr(0)
FP8: tl.constexpr = tl.constexpr(1)
INT8: tl.constexpr = tl.constexpr(2)
INT4: tl.constexpr = tl.constexpr(3)
CODES = {"fp8": FP8.value, "int8": INT8.value, "int4": INT4.value}


@dataclass(frozen=True)
class QuantizedLayer:
    """A quantized cache layer's scales and format, read with its codes (attention/quantized_kv.py's rows layout):
    k_scales a byte per channel of a block [kv_heads, N, d] (int8, int4) or float16 per row [kv_heads, N, bs, 1]
    (fp8); v_scales float16 [kv_heads, N, bs, groups]."""

    format: KVFormat
    k_scales: torch.Tensor
    v_scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.format.name not in CODES:
            raise ValueError(f"kv_cache_dtype: {self.format.name} has no Triton kernel (fp8, int8 and int4 do)")


@cache
def _channel_scale_table(device: torch.device) -> torch.Tensor:
    return CHANNEL_SCALE_TABLE.to(device)


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: QuantizedLayer | None) -> dict:
    """What the kernels take about a layer's cache: its pointers, the strides of a block, a token and a KV head
    (the same for K and V), and the format's constants."""
    if quantized is None:  # [N, bs, H, d]; no scales: the scale pointers are never read
        return dict(k_ptr=k_cache, v_ptr=v_cache, ks_ptr=k_cache, vs_ptr=v_cache, table_ptr=k_cache,
                    stride_kn=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
                    stride_ksn=0, stride_kst=0, stride_ksh=0, stride_vsn=0, stride_vst=0, stride_vsh=0,
                    FORMAT=PLAIN.value, KEY_CHANNELS=False, KEY_GROUP=1, VALUE_GROUP=1)
    fmt, ks, vs = quantized.format, quantized.k_scales, quantized.v_scales
    head_dim = k_cache.shape[-1] * 8 // fmt.bits
    return dict(k_ptr=k_cache, v_ptr=v_cache, ks_ptr=ks, vs_ptr=vs, table_ptr=_channel_scale_table(ks.device),
                stride_kn=k_cache.stride(1), stride_kt=k_cache.stride(2), stride_kh=k_cache.stride(0),
                stride_ksn=ks.stride(1), stride_kst=0 if fmt.key_channels else ks.stride(2), stride_ksh=ks.stride(0),
                stride_vsn=vs.stride(1), stride_vst=vs.stride(2), stride_vsh=vs.stride(0),
                FORMAT=CODES[fmt.name], KEY_CHANNELS=fmt.key_channels, KEY_GROUP=fmt.group or head_dim,
                VALUE_GROUP=fmt.group or head_dim)


@triton.jit
def _codes(ptr, rows, d, mask, FORMAT: tl.constexpr):
    """The values a tile's codes hold before scaling, float32 [rows, BLOCK_D] (rows: each row's first byte)."""
    if FORMAT == INT4:  # two a byte, the even dim in the low nibble, offset by 8
        b = tl.load(ptr + rows[:, None] + d[None, :] // 2, mask=mask, other=0).to(tl.int32)
        return ((b >> ((d[None, :] % 2) * 4)) & 15).to(tl.float32) - 8.0
    b = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0).to(tl.int32)
    if FORMAT == INT8:
        return (b - (b >= 128).to(tl.int32) * 256).to(tl.float32)
    # fp8 e4m3: its 7 bits below the sign, placed as a float16's exponent and mantissa, hold the value over 2^8
    # (the exponent biases 7 and 15), subnormals included
    magnitude = ((b & 127) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _read_tile(ptr, scales_ptr, table_ptr, block, offset, kv_head, d, mask,
               stride_n, stride_t, stride_h, stride_sn, stride_st, stride_sh,
               FORMAT: tl.constexpr, CHANNELS: tl.constexpr, GROUP: tl.constexpr):
    """One KV head's keys or values at (block, offset) [rows, BLOCK_D]: as stored, or dequantized to float32
    (CHANNELS: a scale byte per channel of the block, through the table; else float16 per GROUP values of a row)."""
    # one return: Triton's compiler refuses returns of two types even in branches of a constexpr `if`
    rows = block * stride_n + offset * stride_t + kv_head * stride_h
    if FORMAT == PLAIN:
        tile = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    elif CHANNELS:
        e = tl.load(scales_ptr + kv_head * stride_sh + block[:, None] * stride_sn + d[None, :], mask=mask, other=0)
        tile = _codes(ptr, rows, d, mask, FORMAT) * tl.load(table_ptr + e.to(tl.int32))
    else:
        s = tl.load(scales_ptr + kv_head * stride_sh + block[:, None] * stride_sn + offset[:, None] * stride_st
                    + d[None, :] // GROUP, mask=mask, other=0.0)
        tile = _codes(ptr, rows, d, mask, FORMAT) * s.to(tl.float32)
    return tile


@triton.jit
def _split_tiles(context_len, first_key, split, num_splits, TILE: tl.constexpr):
    """A split's tiles [from, to) out of its row's live ones, [first_key // TILE, ceil(context_len / TILE))."""
    live_from = first_key // TILE
    live_tiles = tl.cdiv(context_len, TILE) - live_from
    per_split = tl.cdiv(live_tiles, num_splits)
    tile_from = live_from + split * per_split
    return tile_from, tl.minimum(tile_from + per_split, live_from + live_tiles)


@triton.jit
def _softmax_step(scores, m_i, l_i):
    """One tile of the online softmax: scores [rows, keys] (-inf where not visible), the running maximum m_i and
    sum l_i [rows] -> the tile's weights, the factor that rescales what was summed before, the new m_i and l_i."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _split_result(acc, m_i, l_i):
    """A split's output (acc normalised) and its log-sum-exp, -inf where it saw no key."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    return out, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))


@triton.jit(do_not_specialize=STEP_SHAPED_SPLIT)
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, tables_ptr, lens_ptr, starts_ptr, out_ptr, lse_ptr,
    scale, num_splits,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh, stride_ksn, stride_kst, stride_ksh, stride_vsn, stride_vst, stride_vsh,
    stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    FLOAT32_DOT: tl.constexpr, FORMAT: tl.constexpr, KEY_CHANNELS: tl.constexpr, KEY_GROUP: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + row)
    first_key = tl.load(starts_ptr + row) if HAS_WINDOW else 0
    tile_from, tile_to = _split_tiles(context_len, first_key, split, num_splits, TILE)

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
        kv_mask = visible[:, None] & (d < HEAD_DIM)[None, :]
        k = _read_tile(k_ptr, ks_ptr, table_ptr, block, keys % BLOCK_SIZE, kv_head, d, kv_mask,
                       stride_kn, stride_kt, stride_kh, stride_ksn, stride_kst, stride_ksh,
                       FORMAT, KEY_CHANNELS, KEY_GROUP)
        if FLOAT32_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(scores, m_i, l_i)
        v = _read_tile(v_ptr, vs_ptr, table_ptr, block, keys % BLOCK_SIZE, kv_head, d, kv_mask,
                       stride_kn, stride_kt, stride_kh, stride_vsn, stride_vst, stride_vsh, FORMAT, False, VALUE_GROUP)
        if FLOAT32_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out, lse = _split_result(acc, m_i, l_i)
    tl.store(out_ptr + row * stride_ob + split * stride_os + heads[:, None] * stride_oh + d[None, :], out,
             mask=q_mask)
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def _merge_splits_kernel(
    parts_ptr, lse_ptr, out_ptr, sinks_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # splits BLOCK_S at a time, so that one compiled kernel merges any number of them
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse_row = lse_ptr + row * stride_lb + head * stride_lh
    top = tl.full([], float("-inf"), tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.max(tl.load(lse_row + first + s, mask=first + s < num_splits, other=float("-inf")), 0))
    if HAS_SINKS:  # gpt-oss: the head's sink logit joins the denominator and attends to nothing
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        inside = first + s < num_splits
        weights = tl.exp(tl.load(lse_row + first + s, mask=inside, other=float("-inf")) - top)
        parts = tl.load(parts_ptr + row * stride_pb + head * stride_ph + (first + s)[:, None] * stride_ps + d[None, :],
                        mask=inside[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        acc += tl.sum(parts * weights[:, None], 0)
        total += tl.sum(weights, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = acc / total
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def merge_splits(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The splits' outputs parts [B, heads, splits, >= d] weighted by their log-sum-exps lse [B, heads, splits] ->
    out [B, heads, d]; sinks [heads]: one more logit per head in each softmax's denominator (gpt-oss)."""
    batch, heads, splits, block_d = parts.shape
    _merge_splits_kernel[(batch, heads)](
        parts, lse, out, sinks if sinks is not None else lse, splits, parts.stride(0), parts.stride(1),
        parts.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=out.shape[2],
        BLOCK_D=block_d, BLOCK_S=MERGED_SPLITS, HAS_SINKS=sinks is not None)
    return out


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v, stride_block,
                        block_size, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:  # a negative slot is a CUDA graph's padding row: written nowhere
        i = tl.arange(0, BLOCK)
        k = tl.load(k_ptr + token * stride_k + i, mask=i < ROW)
        v = tl.load(v_ptr + token * stride_v + i, mask=i < ROW)
        row = (slot // block_size) * stride_block + (slot % block_size) * ROW
        tl.store(k_cache_ptr + row + i, k, mask=i < ROW)
        tl.store(v_cache_ptr + row + i, v, mask=i < ROW)


@triton.jit(do_not_specialize=["stride_tc"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, out_ptr, tables_ptr, tile_chunks_ptr, tile_offsets_ptr,
    starts_ptr, lengths_ptr, context_lens_ptr, sinks_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kn, stride_kt, stride_kh, stride_ksn, stride_kst, stride_ksh,
    stride_vsn, stride_vst, stride_vsh, stride_ot, stride_oh, stride_tc,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, CHUNKED: tl.constexpr,
    PRECISION: tl.constexpr, FLOAT32_DOT: tl.constexpr, FORMAT: tl.constexpr, KEY_CHANNELS: tl.constexpr,
    KEY_GROUP: tl.constexpr, VALUE_GROUP: tl.constexpr, HAS_SINKS: tl.constexpr,
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
    first_key = 0  # the tile's first query's (kv/layout.py's Window.first_key)
    if HAS_WINDOW:
        if CHUNKED:
            first_key = (context_len - length + offset) // window * window
        else:
            first_key = tl.maximum(context_len - length + offset - window + 1, 0)
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for key_tile in range(first_key // TILE, last_position // TILE + 1):
        keys = key_tile * TILE + tl.arange(0, TILE)
        block = tl.load(tables_ptr + chunk * stride_tc + keys // BLOCK_SIZE, mask=keys < context_len, other=0)
        kv_mask = (keys < context_len)[:, None] & (d < HEAD_DIM)[None, :]
        k = _read_tile(k_ptr, ks_ptr, table_ptr, block, keys % BLOCK_SIZE, kv_head, d, kv_mask,
                       stride_kn, stride_kt, stride_kh, stride_ksn, stride_kst, stride_ksh,
                       FORMAT, KEY_CHANNELS, KEY_GROUP)
        v = _read_tile(v_ptr, vs_ptr, table_ptr, block, keys % BLOCK_SIZE, kv_head, d, kv_mask,
                       stride_kn, stride_kt, stride_kh, stride_vsn, stride_vst, stride_vsh, FORMAT, False, VALUE_GROUP)
        if FLOAT32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        visible = keys[None, :] <= positions[:, None]
        if HAS_WINDOW:
            if CHUNKED:
                visible &= keys[None, :] >= (positions // window * window)[:, None]
            else:
                visible &= keys[None, :] > positions[:, None] - window
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = _softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if HAS_SINKS:  # the sink's share of each denominator (every query sees a key: m_i is finite)
        l_i += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m_i)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (start + offset + i)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_in[:, None] & (d < HEAD_DIM)[None, :])


def _float32_dot(dtype: torch.dtype, quantized: QuantizedLayer | None) -> bool:
    """Products in float32: for float32 models, over a quantized cache (its tiles are widened to float32), and
    under the interpreter, which has no 16-bit dot."""
    return dtype == torch.float32 or quantized is not None or os.environ.get("TRITON_INTERPRET") == "1"


def num_splits(batch: int, kv_heads: int, max_keys: int, multiprocessors: int) -> int:
    """Splits per row that give the step about two programs per multiprocessor, no more than the widest
    row has tiles."""
    wanted = -(-2 * multiprocessors // (batch * kv_heads))
    return max(1, min(wanted, -(-max_keys // TILE), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window_starts: torch.Tensor | None,
                 splits: int, quantized: QuantizedLayer | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, d], one query per row at position context_len - 1; caches [N, block_size, kv_heads, d] (or
    codes [kv_heads, N, block_size, bytes] with `quantized`'s scales); block_tables [B, W]; context_lens [B] (at
    least 1); window_starts [B] or None; sinks [heads] or None -> [B, heads, d]."""
    batch, heads, head_dim = q.shape
    kv_heads, block_size = (k_cache.shape[0], k_cache.shape[2]) if quantized else (k_cache.shape[2], k_cache.shape[1])
    group = heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    parts = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q_ptr=q, tables_ptr=block_tables, lens_ptr=context_lens,
        starts_ptr=window_starts if window_starts is not None else context_lens,
        out_ptr=parts, lse_ptr=lse, scale=scale, num_splits=splits,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_tb=block_tables.stride(0),
        stride_ob=parts.stride(0), stride_oh=parts.stride(1), stride_os=parts.stride(2),
        stride_lb=lse.stride(0), stride_lh=lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=TILE, HAS_WINDOW=window_starts is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(q.dtype, quantized),
        **_cache_args(k_cache, v_cache, quantized),
    )
    return merge_splits(parts, lse, torch.empty_like(q), sinks)


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    """k, v: [T, kv_heads, d] -> cache slots [T] (slot = block * block_size + offset; negative: skipped). The
    caches [N, bs, H, d]: each block's tokens dense, the blocks at any stride (a layer viewing part of its slot's rows,
    attention/backend.py)."""
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape[0] == 0:
        return
    # a token's heads are one contiguous row on both sides (k, v may be views into a fused qkv output)
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
    assert k_cache.stride()[1:] == (row, k_cache.shape[3], 1) and v_cache.stride() == k_cache.stride()
    _cache_write_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0),
                                       k_cache.shape[1], ROW=row, BLOCK=triton.next_power_of_2(row))


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
                  lengths: torch.Tensor, context_lens: torch.Tensor, scale: float, window: Window | None,
                  quantized: QuantizedLayer | None = None, sinks: torch.Tensor | None = None) -> None:
    """Prefill chunks that attend to their sequences' cached context (their own K/V already written): chunk c's
    queries are q rows starts[c] .. starts[c] + lengths[c] - 1, at positions context_lens[c] - lengths[c] on;
    its blocks are tables[c]. Writes those rows of `out` ([T, heads, d], like q). tile_chunks / tile_offsets:
    prefill_tiles' programs. Caches and sinks as paged_decode takes them."""
    _, heads, head_dim = q.shape
    kv_heads, block_size = (k_cache.shape[0], k_cache.shape[2]) if quantized else (k_cache.shape[2], k_cache.shape[1])
    _prefill_kernel[(tile_chunks.shape[0], heads)](
        q_ptr=q, out_ptr=out, tables_ptr=tables, tile_chunks_ptr=tile_chunks, tile_offsets_ptr=tile_offsets,
        starts_ptr=starts, lengths_ptr=lengths, context_lens_ptr=context_lens,
        sinks_ptr=sinks if sinks is not None else lengths, scale=scale, window=window.size if window else 0,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_tc=tables.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_Q=PREFILL_QUERIES, TILE=TILE, HAS_WINDOW=window is not None,
        CHUNKED=window is not None and window.chunked,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(q.dtype, quantized),
        HAS_SINKS=sinks is not None, **_cache_args(k_cache, v_cache, quantized),
    )
