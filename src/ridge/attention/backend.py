"""The attention backend interface: write this step's K/V into the paged cache, attend over it.

Slot s of a layer's cache is (block s // block_size, offset s % block_size). Within a block, the layout
is, by default, the one the CPU decode kernel reads fastest (kernels/paged_attention.cpp): values sit in pairs, one
pair per 32-bit vector lane, so that every lane of a load belongs to a different token (K) or dim (V):
  K: [kv_heads, num_blocks, head_dim / 2, block_size, 2]  (a block's tokens side by side per pair of dims)
  V: [kv_heads, num_blocks, block_size / 2, head_dim, 2]  (token pairs interleaved per dim)
This class is the only place, besides that kernel, that knows it: write() and gather() convert from and to
plain [kv_heads, tokens, head_dim] rows for every other path. The CUDA backend keeps its own layout
(attention/cuda.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from ridge.attention.cascade import SharedPrefix
from ridge.kv.layout import KVLayout, Window, kv_layout


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk in a step: query tokens flat[start:start+length]."""

    start: int
    length: int
    context_len: int  # tokens in the cache once this chunk is written (cached prefix + chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
    # each query's last visible key (cache index) where some query sees past itself: Gemma 3's image tokens see
    # their whole image, which the scheduler keeps within one chunk (never cut); None: every query its own prefix
    last_keys: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where each token of a step goes and what it attends to, for the layers of one KV group (kv/layout.py).
    Decode tokens come first in the flat batch. A query at position p sees keys j <= p, from its window's first
    key on when the group has a window (kv/layout.py)."""

    slot_mapping: torch.Tensor  # [T] cache slot of every token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes], the new token included
    prefills: list[PrefillChunk]
    window: Window | None = None
    # False (an encoder's): a query sees every key of its sequence, the later ones too; then each chunk is its
    # sequence's whole prompt over an empty cache (the scheduler's whole_prompts), and the step has no decodes
    causal: bool = True
    # Where the runner asks for it (h2o eviction, kv/eviction.py): [sequences of the step, width] float32, zeros,
    # decodes' rows first, then each chunk's; the backend adds, in every layer, each sequence's attention
    # probabilities over the blocks of its table (summed over query heads and the tokens of each block) for every
    # decode query and the last OBSERVED_ROWS queries of each chunk.
    attention_mass: torch.Tensor | None = None
    # Where the backend keeps each sequence's last, partly filled block outside the cache (an int2 cache's tails,
    # attention/quantized_kv.py): [sequences of the step] the slot each holds, decodes first, then each chunk's
    tail_slots: torch.Tensor | None = None
    # filled by the backend's prepare()
    decode_mask: torch.Tensor | None = None
    sdpa_chunks: list[SdpaChunk] | None = None
    kernel_rows: KernelRows | None = None
    backend_state: object | None = None  # what another backend's prepare() keeps for its attend()

    @classmethod
    def whole_prompt(cls, num_tokens: int, block_table: list[int], block_size: int, window: Window | None = None,
                     device: torch.device | str = "cpu", causal: bool = True) -> AttentionMetadata:
        """One sequence's tokens 0..num_tokens-1 in one chunk over an empty cache: scoring a text."""
        table = torch.tensor(block_table, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        return cls(
            slot_mapping=table[positions // block_size] * block_size + positions % block_size,
            num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
            prefills=[PrefillChunk(0, num_tokens, num_tokens, table[: -(-num_tokens // block_size)])],
            window=window, causal=causal,
        )

    def window_starts(self, context_lens: torch.Tensor) -> torch.Tensor | None:
        """The first key of rows whose query sits at context_len - 1 (None without a window: key 0)."""
        return None if self.window is None else self.window.first_key(context_lens - 1)

    def rows_as_decodes(self, rows: torch.Tensor) -> AttentionMetadata:
        """Some of the step's tokens (flat indices, ascending), each a query of its own over its sequence's cache up
        to its own position, as a decode reads it: for layers that write no KV (Gemma 4's KV-shared ones), which
        need only the rows whose logits are read. To be prepare()d by the backend; nothing is written."""
        tables, lens, sequences = [], [], []  # each row's, and its sequence's place in the step
        for row in rows.tolist():
            if row < self.num_decodes:
                tables.append(self.decode_block_tables[row])
                lens.append(int(self.decode_context_lens[row]))
                sequences.append(row)
                continue
            i, chunk = next((i, c) for i, c in enumerate(self.prefills) if c.start <= row < c.start + c.length)
            tables.append(chunk.block_table)
            lens.append(chunk.context_len - chunk.length + row - chunk.start + 1)
            sequences.append(self.num_decodes + i)
        width = max(t.shape[0] for t in tables)
        device = self.slot_mapping.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[rows], num_decodes=len(lens),
            decode_block_tables=torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in tables]),
            decode_context_lens=torch.tensor(lens, dtype=torch.long, device=device), prefills=[], window=self.window,
            tail_slots=None if self.tail_slots is None else self.tail_slots[torch.tensor(sequences, device=device)])


# A step's attention metadata: one per KV group, in the layout's order.
StepMetadata = Sequence[AttentionMetadata]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per query head, `sinks` [heads], that attends to nothing (gpt-oss),
    in float32. q: [n, heads, d]; k, v: [kv_heads, L, d]; visible: [n, L] (None: causal, the n queries the last of
    the L keys) -> [n, heads, d]."""
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0).float(), v.repeat_interleave(group, dim=0).float()  # [heads, L, d]
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    if visible is None:
        n, length = q.shape[0], k.shape[1]
        visible = window_mask(torch.arange(length - n, length, device=q.device), torch.arange(length, device=q.device),
                              None)
    weights = sink_softmax(scores.masked_fill(~visible, float("-inf")), sinks)
    return torch.einsum("hnl,hld->nhd", weights, v).to(q.dtype)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of float32 scores [heads, n, L] with one more logit per head, `sinks` [heads], in each denominator
    (the weight it takes attends to nothing) -> [heads, n, L]."""
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def sink_correction_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Attention `out` [n, heads, d] over its keys, with `lse` [n, heads] the natural log of each softmax's
    denominator, made the attention with `sinks` in that denominator too: scaled by Z / (Z + e^sink) =
    sigmoid(lse - sink)."""
    out.mul_(torch.sigmoid(lse - sinks.float()).to(out.dtype).unsqueeze(-1))


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: Window | None,
                last_keys: torch.Tensor | None = None) -> torch.Tensor:
    """[n, L] True where a query at query_pos may see the key at key_pos: causal (up to its last_keys where given),
    within the window."""
    last = query_pos if last_keys is None else last_keys.to(query_pos.device)
    visible = key_pos[None, :] <= last[:, None]
    if window is not None:
        visible &= key_pos[None, :] >= window.first_key(query_pos)[:, None]
    return visible


@dataclass
class SdpaChunk:
    """A prefill chunk attended with SDPA: to this step's k, v (first_block None) or to its cached context
    from first_block on; under `mask` [length, keys], or causal when None."""

    chunk: PrefillChunk
    mask: torch.Tensor | None = None
    first_block: int | None = None


@dataclass
class KernelRows:
    """Query rows that read their context in place through the decode kernel, in one call per layer:
    every decode, and each token of a short chunk that continues a cached context (its own causal prefix)."""

    rows: torch.Tensor | None  # [R] indices into the step's flat tokens; None when they are 0..R-1
    block_tables: torch.Tensor  # [R, max_blocks]; a row in a shared prefix: the blocks after it
    context_lens: torch.Tensor  # [R]; a row in a shared prefix: the tokens after it
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)  # attended once per prefix (cascade)
    window_starts: torch.Tensor | None = None  # [R] each row's first key, with a window (no cascade then)


@dataclass(frozen=True)
class CachePart:
    """One of a layer's cache tensors: its shape over every block, dtype, and the dim that indexes its blocks."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int

    @property
    def nbytes(self) -> int:
        """Bytes per block."""
        return math.prod(self.shape) // self.shape[self.block_dim] * self.dtype.itemsize

    def view(self, rows: torch.Tensor) -> torch.Tensor:
        """This part in its shape over rows of bytes [num_blocks, nbytes], each block's row holding the other dims
        in order."""
        order = (self.block_dim, *(i for i in range(len(self.shape)) if i != self.block_dim))
        part = rows.view(self.dtype).view(*(self.shape[i] for i in order))
        return part.permute(*sorted(range(len(self.shape)), key=order.__getitem__))


class AttentionBackend(ABC):
    """Owns the paged K/V tensors of every layer; stateless otherwise.

    `layers`: the model's KV layout, or a number of full-attention layers. k_cache[layer] is the tensor of
    the layer's slot: layers of different groups share it, each at its own group's block ids.
    """

    storage_dtype: torch.dtype | None = None  # the caches' dtype, where not the model's (a quantized cache's codes)
    handles_sinks = False  # attends with gpt-oss's attention sinks (a model with them refuses the others)
    per_layer_shapes = True  # layers of different head widths or KV heads (kv/layout.py's shapes)

    def __init__(
        self,
        layers: KVLayout | int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """scale: of the scores, head_dim ** -0.5 by default; softcap: scores become softcap * tanh(scores /
        softcap) (Gemma 2), on backends that have it."""
        if block_size % 2 or head_dim % 2:
            raise ValueError(f"block_size ({block_size}) and head_dim ({head_dim}) must be even: values sit in pairs")
        layout = kv_layout([None] * layers) if isinstance(layers, int) else layers
        if layout.shapes is not None and not self.per_layer_shapes:
            raise ValueError(f"attention: layers of different head widths or KV heads (Gemma 4's) are not supported "
                             f"by the {type(self).__name__}")
        self.layout, self.num_blocks, self.group_of_layer = layout, num_blocks, layout.group_of_layer()
        self.dtype, self.device = dtype, torch.device(device)
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.slot_rows: list[torch.Tensor] = []  # a layout with shapes: each slot's bytes, which every part views
        if layout.shapes is None:
            for name, part in self.block_parts(num_kv_heads, head_dim).items():
                setattr(self, name, self._per_layer(layout, part.shape, part.dtype, device))
        else:
            self._carve_slots(layout, device)
        self.scale = scale or head_dim**-0.5
        self.softcap = softcap
        self.ops: ModuleType | None = None  # kernels/cpu_ops.py: C++ cache writes (and decode, if the backend uses it)

    @property
    def layer_shapes(self) -> dict[int, tuple[int, int]]:
        """Each layer with a cache of its own: its (kv heads, head width)."""
        return {layer: self.layout.shapes[layer] if self.layout.shapes is not None
                else (self.num_kv_heads, self.head_dim) for layer in self.layout.slot_of_layer()}

    @staticmethod
    def _per_layer(layout: KVLayout, shape: tuple[int, ...], dtype: torch.dtype,
                   device: str | torch.device) -> dict[int, torch.Tensor]:
        """One zeroed tensor per slot of the layout, indexed by layer number (a layer without a cache of its own, a
        state-space or KV-shared layer, has none)."""
        slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_slots)]
        return {layer: slots[slot] for layer, slot in layout.slot_of_layer().items()}

    def _carve_slots(self, layout: KVLayout, device: str | torch.device) -> None:
        """Layers of different shapes (kv/layout.py): one row of bytes per slot and block id, and each layer's parts
        (block_parts') views of its bytes there in their own shapes: blocks along each part's block dim, each head's
        block dense, as the kernels read them."""
        def parts(heads: int, dim: int) -> list[tuple[str, CachePart]]:
            # the widest elements first, so that every part starts aligned to its dtype
            return sorted(self.block_parts(heads, dim).items(), key=lambda part: -part[1].dtype.itemsize)

        carving = layout.carve(lambda heads, dim: sum(part.nbytes for _, part in parts(heads, dim)))
        self.slot_rows = [torch.zeros(self.num_blocks, width, dtype=torch.uint8, device=device)
                          for width in carving.slot_bytes]
        slot_of_layer = layout.slot_of_layer()
        for name in self.block_parts(self.num_kv_heads, self.head_dim):
            setattr(self, name, {})
        for layer, offset in carving.offsets.items():
            rows = self.slot_rows[slot_of_layer[layer]]
            for name, part in parts(*layout.shapes[layer]):
                getattr(self, name)[layer] = part.view(rows[:, offset:offset + part.nbytes])
                offset += part.nbytes

    def block_parts(self, num_kv_heads: int, head_dim: int) -> dict[str, CachePart]:
        """The tensors a layer of this shape keeps over the blocks, by the attribute that holds them by layer: its K
        and V (cache_shapes'), and a quantized cache's scales."""
        dtype = self.storage_dtype or self.dtype
        k_shape, v_shape = self.cache_shapes(num_kv_heads, self.num_blocks, head_dim, self.block_size)
        return {"k_cache": CachePart(k_shape, dtype, self.block_dim),
                "v_cache": CachePart(v_shape, dtype, self.block_dim)}

    block_dim = 1  # the dim of a cache tensor (cache_shapes') that indexes its blocks

    def block_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor of the cache (each layout slot's, in layer order) with the dim that indexes its blocks: what
        a block's KV is, to copy whole blocks to another engine of the same model and layout (engine/kv_transfer.py)."""
        if self.slot_rows:  # layers of different shapes: their slots' rows, which hold every layer's view
            return [(rows, 0) for rows in self.slot_rows]
        tensors = {id(t): t for layer in self.k_cache for t in (self.k_cache[layer], self.v_cache[layer])}
        return [(t, self.block_dim) for t in tensors.values()]

    def read_blocks(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """Copies of these blocks of every cache tensor (block_tensors' order), on the CPU: [len(blocks), ...one
        block] each, what another engine of the same model and layout takes with write_blocks."""
        return [t.index_select(dim, blocks.to(t.device)).movedim(dim, 0).contiguous().cpu()
                for t, dim in self.block_tensors()]

    def takes_blocks(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> bool:
        """Whether blocks of these (shape, dtype), read_blocks' form, fit this cache's tensors."""
        tensors = self.block_tensors()
        return len(shapes) == len(tensors) and all(
            tuple(shape[1:]) == tuple(t.movedim(dim, 0).shape[1:]) and dtype == t.dtype
            for (shape, dtype), (t, dim) in zip(shapes, tensors, strict=True))

    def write_blocks(self, blocks: torch.Tensor, data: list[torch.Tensor]) -> None:
        """data (read_blocks' form, one row per block) into these blocks of the cache."""
        for rows, (tensor, dim) in zip(data, self.block_tensors(), strict=True):
            tensor.index_copy_(dim, blocks.to(tensor.device), rows.movedim(0, dim).to(tensor.device))

    def cache_shapes(self, num_kv_heads: int, num_blocks: int, head_dim: int,
                     block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one slot's K and V tensors (the CPU kernel's layout; a backend with its own layout
        overrides this, write() and gather())."""
        return ((num_kv_heads, num_blocks, head_dim // 2, block_size, 2),
                (num_kv_heads, num_blocks, block_size // 2, head_dim, 2))

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Per-step work shared by all layers (masks); called once before the forward pass."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] -> the cache slots of those tokens."""
        if self.ops is not None:
            self.ops.cache_write_(self.k_cache[layer], self.v_cache[layer], k, v, slots)
            return
        blocks, offsets = slots // self.block_size, slots % self.block_size
        # permuted views of the caches, indexed by (block, offset) first
        k_slots = self.k_cache[layer].permute(1, 3, 0, 2, 4)  # [N, bs, H, d/2, 2]
        k_slots.index_put_((blocks, offsets), k.unflatten(-1, (k.shape[-1] // 2, 2)))
        v_slots = self.v_cache[layer].permute(1, 2, 4, 0, 3)  # [N, bs/2, 2, H, d]
        v_slots.index_put_((blocks, offsets // 2, offsets % 2), v)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block ids [..., n] -> K, V of shape [kv_heads, ..., n * block_size, head_dim] (copies)."""
        if self.ops is not None and block_table.dim() == 1:
            return self.ops.cache_gather(self.k_cache[layer], self.v_cache[layer], block_table)
        k = self.k_cache[layer][:, block_table].transpose(-3, -2)  # [H, ..., n, bs, d/2, 2]
        v = self.v_cache[layer][:, block_table].transpose(-2, -1)  # [H, ..., n, bs/2, 2, d]
        shape = (*k.shape[:-4], k.shape[-4] * self.block_size, v.shape[-1])
        return k.reshape(shape), v.reshape(shape)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMetadata,
        sinks: torch.Tensor | None = None, write: bool = True,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim]. sinks: [heads], the
        layer's attention sinks, on a backend that handles_sinks. write False: k, v are in `layer`'s cache already
        (a KV-shared layer attends to its source's, written by it this step)."""
        meta = step[self.group_of_layer[layer]]
        if write:
            self.write(layer, k, v, meta.slot_mapping)
        return self.attend(layer, q, k, v, meta) if sinks is None else self.attend(layer, q, k, v, meta, sinks)

    @abstractmethod
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention over the cache, which already holds this step's k, v (passed for backends that can
        use them directly)."""
