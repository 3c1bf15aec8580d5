"""The paged backend over a quantized KV cache (`--kv-cache-dtype fp8|int8|int4`, kv/formats.py).

Each token's K and V rows are quantized as they enter the cache (write): codes (uint8) and scales, values' a
float16 per row, keys' per row (fp8) or per channel of a block (int8, int4: grown as the block fills); in C++
where the decode kernel runs (quantized_cache_write_, the same rounding in one pass), else in torch. A prompt
chunk that is its sequence's whole context attends to its own K and V before rounding (as vLLM's prefill does);
everything later reads the rounded rows.

Decodes of an int8, fp8 or int4 cache run in a C++ kernel that widens the codes in registers as it reads them
(kernels/quantized_attention.cpp), on AVX512 with blocks of 16 and head dims a multiple of 64; that kernel's
layout keeps a 32-bit lane's values side by side, four dims of a token (K) or a dim of four tokens (V) for 8 bits,
eight dims of a token for int4's keys:
  K codes [kv_heads, num_blocks, code bytes / 4, block_size, 4]    V codes [kv_heads, num_blocks, block_size / 4, d, 4]
int4's values, and int2's keys and values, are rows [kv_heads, num_blocks, block_size, code bytes]. Everything
else (continuation chunks, int2, other CPUs) dequantizes what it reads (gather) and runs the paged backend's torch
path (SDPA). Scales: [kv_heads, num_blocks, block_size, groups] float16; keys per channel [kv_heads, num_blocks,
head_dim], a byte each.

int2 (kv/formats.py) quantizes a block only when it is full. Until then its rows wait in the model's dtype in its
sequence's tail: one block's K and V per layer, in the slot the KV manager hands the sequence with its first blocks
(kv/state_cache.py's slots; AttentionMetadata.tail_slots). A write takes each block it touches whole: the tail's
rows below the first offset written now, then the step's; a block whose last offset is written is quantized and
stored, the others go back to their tails. A read overlays each block still filling with its tail (_context).
Only the block a sequence is filling waits there, so every block the prefix cache or a prefill/decode transfer
sees is whole; a rewind into a block already quantized could not take it back, so speculation is refused. int2's
keys and values are stored less their midranges (k_mids [kv_heads, num_blocks, head_dim], v_mids as v_scales,
float16), added back as they are read.

Keys are stored less a constant per layer and KV head, their center (set_key_centers): softmax does not change when
every score of a query moves by the same amount, and q . (k - c) = q . k - q . c moves each of a query's scores by
q . c, so attention over centered keys is attention over the keys themselves, exactly (up to rounding), while the
rounding now sees only what varies from key to key. Every key a query reads comes from the cache, centered alike
(a whole-context prompt chunk reads its own uncentered k, and nothing else). The center is the key bias's mean
under rotary over the first positions (Attention.key_center): biases like Qwen2's make a few channels far larger
than the rest, and a scale sized for those leaves the others few levels (docs/notes/kv-compression.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from ridge.attention.backend import AttentionMetadata, CachePart, KernelRows, StepMetadata, sink_correction_
from ridge.attention.paged import PagedBackend
from ridge.kv.formats import (
    CHANNEL_SCALE_STEPS,
    SCALE_DTYPE,
    KVFormat,
    decode_channel_scales,
    encode_channel_scales,
)

log = logging.getLogger("ridge")

# The positions a key center averages the bias's rotation over (or the engine's whole context, if shorter): where
# most of a cache's keys sit. The slow channels that carry the large biases turn by hundredths of a radian over them
# and keep their full bias in the center at any length; a faster channel's mean over 32k positions is near zero and
# centers less of what 4k-token contexts hold (docs/notes/kv-compression.md).
KEY_CENTER_POSITIONS = 4096


@dataclass
class BlockWrites:
    """Where a step's keys go, by block: what channel-scaled keys need to grow each block's scales."""

    blocks: torch.Tensor  # [T] each key's block
    offsets: torch.Tensor  # [T] and offset in it
    touched: torch.Tensor  # [U] the blocks written, each once
    which: torch.Tensor  # [T] each key's index into touched
    continued: torch.Tensor  # [U] whether the block holds keys from earlier steps (below the first offset written)

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int) -> BlockWrites:
        blocks, offsets = slots // block_size, slots % block_size
        touched, which = torch.unique(blocks, return_inverse=True)
        # blocks fill in order, so a block's earlier keys are those below the first offset written now; a block
        # written from offset 0 starts afresh, whatever scales its last holder left
        first = torch.full_like(touched, block_size).scatter_reduce_(0, which, offsets, "amin")
        return cls(blocks, offsets, touched, which, first > 0)


@dataclass
class TailStep:
    """A step's writes over a cache with tails (int2): the blocks it touches, whose rows it takes whole."""

    writes: BlockWrites
    slots: torch.Tensor  # [U] the tail slot of each touched block's sequence
    full: torch.Tensor  # [U] whether the block's last offset is written now: then it is quantized
    slot_of_block: torch.Tensor  # [num_blocks] the tail slot of each block the step reads still filling, else -1

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int, num_blocks: int) -> TailStep:
        assert meta.tail_slots is not None, "a cache with tails needs each sequence's tail slot (tail_slots)"
        device = meta.tail_slots.device
        tokens = torch.tensor([1] * meta.num_decodes + [chunk.length for chunk in meta.prefills], device=device)
        writes = BlockWrites.of(meta.slot_mapping, block_size)
        slots = torch.zeros_like(writes.touched).scatter_(0, writes.which, meta.tail_slots.repeat_interleave(tokens))
        last = torch.full_like(writes.touched, -1).scatter_reduce_(0, writes.which, writes.offsets, "amax")
        # what each sequence reads after the step's writes: its context, whose last block may still be filling
        chunk_lens = torch.tensor([chunk.context_len for chunk in meta.prefills], dtype=torch.long, device=device)
        lens = torch.cat([meta.decode_context_lens, chunk_lens])
        last_blocks = torch.cat([meta.decode_block_tables[torch.arange(meta.num_decodes, device=device),
                                                          (meta.decode_context_lens - 1) // block_size],
                                 torch.stack([chunk.block_table[-1] for chunk in meta.prefills]) if meta.prefills
                                 else lens.new_zeros(0)])
        filling = lens % block_size != 0
        slot_of_block = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        slot_of_block[last_blocks[filling]] = meta.tail_slots[filling]
        return cls(writes, slots, last == block_size - 1, slot_of_block)


class QuantizedKVBackend(PagedBackend):
    storage_dtype = torch.uint8
    cascade = False
    lane_layout = True  # codes in the CPU kernel's lanes (above); a subclass read by other kernels keeps rows
    block_dim = 1  # codes and scales alike [kv_heads, num_blocks, ...], whichever backend attends

    def __init__(self, *args, kv_format: KVFormat, num_tail_slots: int = 0, **kwargs) -> None:
        """num_tail_slots: sequences that can hold a tail at once (a format with tails: the most that run)."""
        self.format = kv_format
        self.key_lanes = kv_format.bits in (8, 4) and self.lane_layout
        self.value_lanes = kv_format.bits == 8 and self.lane_layout
        self.kernels: ModuleType | None = None
        self.key_centers: dict[int, torch.Tensor] = {}  # by layer: [kv_heads, head_dim] float32
        self.k_mids: dict[int, torch.Tensor] = {}  # a format without midranges has none
        self.v_mids: dict[int, torch.Tensor] = {}
        super().__init__(*args, **kwargs)
        for _, dim in self.layer_shapes.values():
            kv_format.check(dim)
        if kv_format.tail and num_tail_slots < 1:
            raise ValueError(f"kv_cache_dtype: {kv_format.name} keeps each running sequence's last block in a tail "
                             "slot; num_tail_slots must be at least 1")
        # a layer's own (layers of two KV groups share a cache tensor at their own block ids, but a slot is a
        # sequence's in every layer): [slots, block_size, kv_heads, head_dim] in the model's dtype, as computed
        self.k_tails, self.v_tails = (
            {layer: torch.zeros(num_tail_slots, self.block_size, heads, dim, dtype=self.dtype, device=self.device)
             for layer, (heads, dim) in self.layer_shapes.items()} if kv_format.tail else {} for _ in range(2))

    def block_parts(self, num_kv_heads: int, head_dim: int) -> dict[str, CachePart]:
        """The codes (cache_shapes'), their float16 scales [kv_heads, num_blocks, block_size, groups] (keys per
        channel: a byte each, [kv_heads, num_blocks, head_dim]), and the midranges of a format with them (keys' per
        channel of a block, values' as their scales)."""
        rows = (num_kv_heads, self.num_blocks, self.block_size, self.format.groups(head_dim))
        channels = (num_kv_heads, self.num_blocks, head_dim)
        parts = {**super().block_parts(num_kv_heads, head_dim),
                 "k_scales": (CachePart(channels, torch.uint8, 1) if self.format.key_channels
                              else CachePart(rows, SCALE_DTYPE, 1)),
                 "v_scales": CachePart(rows, SCALE_DTYPE, 1)}
        if self.format.mids:
            parts |= {"k_mids": CachePart(channels, SCALE_DTYPE, 1), "v_mids": CachePart(rows, SCALE_DTYPE, 1)}
        return parts

    def set_key_centers(self, centers: dict[int, torch.Tensor]) -> None:
        """The constant taken off each layer's keys before they are rounded (above); a layer without one stores its
        keys as they are."""
        self.key_centers = {layer: c.to(self.device, torch.float32) for layer, c in centers.items()}

    def block_tensors(self) -> list[tuple[torch.Tensor, int]]:
        if self.slot_rows:  # the scales are views of the slots' rows too
            return super().block_tensors()
        scales = {id(t): t for caches in (self.k_scales, self.v_scales, self.k_mids, self.v_mids)
                  for t in caches.values()}
        return super().block_tensors() + [(t, 1) for t in scales.values()]

    # PagedBackend's `ops` drives its bf16 / float32 kernel paths, which read plain caches: this backend hands
    # them nothing, and keeps the kernels for its own decode (set by the runner, as `ops` is elsewhere)
    @property
    def ops(self) -> None:
        return None

    @ops.setter
    def ops(self, kernels: ModuleType | None) -> None:
        fast = (kernels is not None and self.key_lanes and self.block_size == 16
                and all(dim % 64 == 0 for _, dim in self.layer_shapes.values())
                and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
        self.kernels = kernels if fast else None
        if kernels is not None and not fast:
            log.warning("ridge: kv_cache_dtype %s: decode attention dequantizes the cache through torch (ridge's "
                        "kernel reads int8 / fp8 / int4 with AVX512, blocks of 16 and head dims a multiple of 64), "
                        "slower per token", self.format.name)

    def cache_shapes(self, num_kv_heads: int, num_blocks: int, head_dim: int,
                     block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        rows = (num_kv_heads, num_blocks, block_size, self.format.code_bytes(head_dim))
        keys = (num_kv_heads, num_blocks, self.format.code_bytes(head_dim) // 4, block_size, 4)
        values = (num_kv_heads, num_blocks, block_size // 4, head_dim, 4)
        return keys if self.key_lanes else rows, values if self.value_lanes else rows

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.kernels is None:
            super().prepare(meta)
            # the same for every layer of the group: worked out once a step
            if self.format.tail:
                meta.backend_state = TailStep.of(meta, self.block_size, self.num_blocks)
            elif self.format.key_channels:
                meta.backend_state = BlockWrites.of(meta.slot_mapping, self.block_size)
            return
        # decodes through the kernel, as kernel rows (what the fused decode stack serves); chunks through SDPA
        if meta.num_decodes:
            meta.kernel_rows = KernelRows(None, meta.decode_block_tables, meta.decode_context_lens,
                                          window_starts=meta.window_starts(meta.decode_context_lens))
        meta.sdpa_chunks = [self._sdpa_chunk(chunk, meta.window) for chunk in meta.prefills]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                step: StepMetadata, sinks: torch.Tensor | None = None, write: bool = True) -> torch.Tensor:
        meta = step[self.group_of_layer[layer]]
        if write:
            self.write(layer, k, v, meta.slot_mapping, meta.backend_state)
        return self.attend(layer, q, k, v, meta) if sinks is None else self.attend(layer, q, k, v, meta, sinks)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              writes: BlockWrites | TailStep | None = None) -> None:
        """writes: slots' blocks as prepare() found them (made here when not given; a format with tails needs them)."""
        if self.format.tail:
            assert isinstance(writes, TailStep), "a cache with tails is written with the step's TailStep"
            self._write_through_tails(layer, k, v, writes)
            return
        center = self.key_centers.get(layer)
        if self.kernels is not None:  # the same rounding in C++, in one pass (the fused decode stack's write)
            self.kernels.quantized_cache_write_(self.k_cache[layer], self.v_cache[layer], self.k_scales[layer],
                                                self.v_scales[layer], k, v, slots, center, self.format.name == "fp8")
            return
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k = k.float() if center is None else k.float() - center
        if self.format.key_channels:
            self._write_channel_keys(layer, k, writes or BlockWrites.of(slots, self.block_size))
        else:
            k_codes, k_scales = self.format.quantize(k)  # [T, kv_heads, ...]
            self.k_scales[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), k_scales)  # (block, offset) first
            if self.key_lanes:
                self.k_cache[layer].permute(1, 3, 0, 2, 4).index_put_((blocks, offsets), k_codes.unflatten(-1, (-1, 4)))
            else:
                self.k_cache[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), k_codes)
        v_codes, v_scales = self.format.quantize(v)
        self.v_scales[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), v_scales)
        if self.value_lanes:
            v_view = self.v_cache[layer].permute(1, 2, 4, 0, 3)  # [N, bs/4, 4, H, d]
            v_view.index_put_((blocks, offsets // 4, offsets % 4), v_codes)
        else:
            self.v_cache[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), v_codes)

    def _write_through_tails(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: TailStep) -> None:
        """Each touched block whole, in the model's dtype: the tail's rows below the first offset written now, then
        this step's; full blocks quantized (rounded once), the others back to their tails."""
        writes = step.writes
        blocks = []
        for tails, rows in ((self.k_tails[layer], k), (self.v_tails[layer], v)):
            held = tails[step.slots]  # [U, bs, H, d]; a block written from offset 0 takes none of it
            held[writes.which, writes.offsets] = rows.to(self.dtype)
            tails[step.slots[~step.full]] = held[~step.full]  # a sequence fills one block at a time: slots unique
            blocks.append(held[step.full].flatten(0, 1))
        if step.full.any():
            full = writes.touched[step.full]
            slots = (full.unsqueeze(1) * self.block_size + torch.arange(self.block_size, device=full.device)).flatten()
            self._quantize_blocks(layer, blocks[0], blocks[1], slots)

    def _quantize_blocks(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Whole blocks' rows [T, H, d] (T a multiple of block_size, each block's from offset 0) into the cache."""
        center = self.key_centers.get(layer)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k = k.float() if center is None else k.float() - center
        if self.format.mids:
            self._write_key_blocks(layer, k, blocks[::self.block_size])
            grouped = v.float().unflatten(-1, (self.format.groups(v.shape[-1]), -1))
            mids = ((grouped.amax(-1) + grouped.amin(-1)) / 2).to(SCALE_DTYPE)
            self.v_mids[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), mids)
            v = (grouped - mids.float().unsqueeze(-1)).flatten(-2)
        else:
            self._write_channel_keys(layer, k, BlockWrites.of(slots, self.block_size))  # from offset 0: rounded once
        v_codes, v_scales = self.format.quantize(v)
        self.v_scales[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), v_scales)
        self.v_cache[layer].permute(1, 2, 0, 3).index_put_((blocks, offsets), v_codes)

    def _write_key_blocks(self, layer: int, k: torch.Tensor, blocks: torch.Tensor) -> None:
        """Whole blocks' keys [n * block_size, H, d] (float32) into blocks [n]: each channel of a block less its
        midrange, on a scale that spans the rest (the smallest scale byte >= half the range over code_max)."""
        rows = k.unflatten(0, (-1, self.block_size))  # [n, bs, H, d]
        high, low = rows.amax(1), rows.amin(1)  # [n, H, d]
        mids = ((high + low) / 2).to(SCALE_DTYPE)
        scale_bytes = encode_channel_scales((high - low) / 2 / self.format.code_max)
        scales = decode_channel_scales(scale_bytes).clamp(min=1e-30)
        codes = self.format.encode((rows - mids.float().unsqueeze(1)) / scales.unsqueeze(1))  # [n, bs, H, bytes]
        self.k_cache[layer][:, blocks] = codes.permute(2, 0, 1, 3)
        self.k_scales[layer][:, blocks] = scale_bytes.transpose(0, 1)
        self.k_mids[layer][:, blocks] = mids.transpose(0, 1)

    def _context(self, layer: int, block_table: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """gather(), each block still filling overlaid with its tail (centered as the cache's keys are)."""
        k, v = self.gather(layer, block_table)
        if not self.format.tail:
            return k, v
        slot = meta.backend_state.slot_of_block[block_table]  # [..., n]
        filling = slot >= 0
        if not filling.any():
            return k, v
        held = slot[filling]
        center = self.key_centers.get(layer)
        k_rows = self.k_tails[layer][held]  # [F, bs, H, d]
        if center is not None:
            k_rows = (k_rows.float() - center).to(self.dtype)
        for out, rows in ((k, k_rows), (v, self.v_tails[layer][held])):
            out.unflatten(-2, (-1, self.block_size))[:, filling] = rows.permute(2, 0, 1, 3)  # [H, F, bs, d]
        return k, v

    def _write_channel_keys(self, layer: int, k: torch.Tensor, writes: BlockWrites) -> None:
        """Keys [T, kv_heads, d] (float32) into blocks whose scales are per channel (kv/formats.py): each block this
        step writes to grows its channel scales to its new keys, its earlier keys requantized where one grew."""
        codes, scale_bytes = self.k_cache[layer], self.k_scales[layer]  # (layout above), [H, N, d]
        touched, which = writes.touched, writes.which
        held = scale_bytes[:, touched] * writes.continued.view(1, -1, 1)  # [H, U, d]; a fresh block holds none
        amax = k.new_zeros(len(touched), *k.shape[1:]).scatter_reduce_(0, which.view(-1, 1, 1).expand_as(k), k.abs(),
                                                                       "amax")
        wanted = encode_channel_scales(amax.transpose(0, 1) / self.format.code_max)
        # a scale that grows at least doubles (CHANNEL_SCALE_STEPS bytes), so that the roundings a key takes as its
        # block fills add up to less than one step of the final scale (1/2 + 1/4 + ...), not one per growth
        doubled = torch.where(held > 0, (held.int() + CHANNEL_SCALE_STEPS).clamp_(max=255), 0).to(torch.uint8)
        grown = torch.where(wanted > held, torch.maximum(wanted, doubled), held)
        if bool(((grown > held) & (held > 0)).any()):  # keys already there, at a scale that grew
            ratio = decode_channel_scales(held) / decode_channel_scales(grown)  # 1 where nothing grew
            earlier = self.format.decode(self._key_rows(codes[:, touched])) * ratio.unsqueeze(2)  # [H, U, bs, d]
            codes[:, touched] = self._key_blocks(self.format.encode(earlier))
        scale_bytes[:, touched] = grown
        scales = decode_channel_scales(grown)[:, which].transpose(0, 1)  # [T, H, d]: each key's block's
        rows = self.format.encode(k / scales.clamp(min=1e-30))
        if self.key_lanes:
            codes.permute(1, 3, 0, 2, 4).index_put_((writes.blocks, writes.offsets), rows.unflatten(-1, (-1, 4)))
        else:
            codes.permute(1, 2, 0, 3).index_put_((writes.blocks, writes.offsets), rows)

    def _key_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """K codes of blocks [H, ..., n, (layout)] as rows [H, ..., n, block_size, code bytes]."""
        return blocks.transpose(-3, -2).flatten(-2) if self.key_lanes else blocks

    def _key_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """_key_rows' inverse."""
        return rows.unflatten(-1, (-1, 4)).transpose(-3, -2) if self.key_lanes else rows

    def _code_rows(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes of blocks [..., n] as rows [kv_heads, ..., n, block_size, code bytes] (copies in lanes)."""
        k, v = self.k_cache[layer][:, block_table], self.v_cache[layer][:, block_table]
        if self.value_lanes:
            v = v.transpose(-2, -1).flatten(-3, -2)  # [H, ..., n, bs/4, d, 4] -> [H, ..., n, bs, d]
        return self._key_rows(k), v  # [H, ..., n, bytes/4, bs, 4] -> [H, ..., n, bs, bytes]

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block ids [..., n] -> K, V of shape [kv_heads, ..., n * block_size, head_dim], dequantized."""
        k_codes, v_codes = self._code_rows(layer, block_table)
        if self.format.key_channels:  # [H, ..., n, bs, d] x each block's channel scales
            scales = decode_channel_scales(self.k_scales[layer][:, block_table]).unsqueeze(-2)
            k = self.format.decode(k_codes) * scales
            if self.format.mids:
                k += self.k_mids[layer][:, block_table].float().unsqueeze(-2)
            k = k.to(self.dtype)
        else:
            k = self.format.dequantize(k_codes, self.k_scales[layer][:, block_table], self.dtype)
        v_scales = self.v_scales[layer][:, block_table]
        if self.format.mids:  # [H, ..., n, bs, groups, values] plus each group's midrange
            v = self.format.dequantize(v_codes, v_scales, torch.float32).unflatten(-1, (v_scales.shape[-1], -1))
            v = (v + self.v_mids[layer][:, block_table].float().unsqueeze(-1)).flatten(-2).to(self.dtype)
        else:
            v = self.format.dequantize(v_codes, v_scales, self.dtype)
        if self.slot_rows:
            # a block's rows past its sequence's tokens may hold bytes this layer never wrote (a block last held by
            # a layer of another shape), as floats an infinity or a NaN, which a zero weight would not silence
            k, v = torch.nan_to_num_(k, 0.0, 0.0, 0.0), torch.nan_to_num_(v, 0.0, 0.0, 0.0)
        return k.flatten(-3, -2), v.flatten(-3, -2)

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels is None:
            return super()._decode(layer, q, meta, sinks)
        kernel = meta.kernel_rows
        out, lse = self.kernels.quantized_paged_decode(
            q, self.k_cache[layer], self.v_cache[layer], self.k_scales[layer], self.v_scales[layer],
            kernel.block_tables, kernel.context_lens, self.scale, kernel.window_starts, fp8=self.format.name == "fp8",
            mass=None if meta.attention_mass is None else meta.attention_mass[:q.shape[0]])
        if sinks is not None:
            sink_correction_(out, lse, sinks)
        return out
