"""The batched paged backend: all decodes of a step in one call, GQA without repeating K/V.

On the CPU, decodes run in a C++ kernel that reads K/V straight from their blocks
(kernels/paged_attention.cpp). Elsewhere (CUDA, or no compiler) they are gathered into a padded
batch for one SDPA call, with the query heads that share a K/V head folded into the query-length axis
([kv_heads, group * n, d]). Prefill chunks go through SDPA one sequence at a time with enable_gqa: a
chunk that is its sequence's whole context attends to this step's k, v directly under is_causal
(twice as fast on the CPU as an explicit mask); a chunk that continues a cached context (a
prefix-cache hit, or a long prompt's later chunk) gathers the cache under a mask built once per step in
prepare(), or, when short and in bf16 on the CPU, reads the blocks in place through the decode kernel,
in the same call as the step's decodes: at batch 64 a speculative step verifies 64 short chunks, and a
kernel call per chunk and layer cost more than the attention itself. Kernel rows that share a long
prefix (a prefix-cache hit's decodes, samples, a chunk's tokens) attend to it once, together, through
torch's flash attention, and only their own suffixes through the kernel (attention/cascade.py).

An encoder's step (AttentionMetadata.causal False) holds whole prompts only, each attended by SDPA without a
mask: every query sees its whole sequence.

A KV group with a sliding window reads only the window: the kernel starts each row at its window's first
key, and SDPA gathers a chunk's context from the block its first query's window starts in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.attention import cascade
from ridge.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KernelRows,
    PrefillChunk,
    SdpaChunk,
    sink_attention,
    sink_correction_,
    window_mask,
)
from ridge.attention.mass import block_mass
from ridge.kv.eviction import OBSERVED_ROWS
from ridge.kv.layout import Window

# A continuation chunk up to this many tokens reads its context in place through the decode kernel; a
# longer one gathers the context for masked SDPA, whose matmuls run faster on long chunks
# (docs/notes/kernel-choices.md).
IN_PLACE_MAX_CHUNK = 64


class PagedBackend(AttentionBackend):
    # the kernel's rows corrected by their softmax denominators; SDPA's chunks and the torch decodes computed with
    # the sink logit (attention/backend.py)
    handles_sinks = True
    cascade = True  # kernel rows that share a prefix attend to it once, together (attention/cascade.py)
    # every query row through the decode kernel, its context read in place: a row's attention then depends on
    # its own query and context alone, not on the step's other rows, its chunking or a shared prefix
    # (kernels/batch_invariance.py)
    batch_invariant = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.softcap:  # neither torch's SDPA nor the kernel caps scores
            raise ValueError("attention_backend: paged has no attention logit soft-capping (Gemma 2); use reference")

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        if not meta.causal:  # an encoder's whole prompts, each attended at once with SDPA
            assert not meta.num_decodes and all(c.context_len == c.length for c in meta.prefills), \
                "attention to later tokens needs whole prompts (the scheduler's whole_prompts)"
            meta.sdpa_chunks = [SdpaChunk(chunk) for chunk in meta.prefills]
            return
        if self.batch_invariant:
            self._all_kernel_rows(meta)
            return
        if meta.num_decodes and self.ops is None:
            width = meta.decode_block_tables.shape[1] * self.block_size
            positions = torch.arange(width, device=device)
            visible = positions < meta.decode_context_lens.unsqueeze(1)
            if meta.window is not None:
                visible &= positions >= meta.window_starts(meta.decode_context_lens).unsqueeze(1)
            meta.decode_mask = visible[None, :, None, :]  # [1, B, 1, L]: broadcast over kv heads and the query group
        if self.ops is not None and meta.num_decodes and not meta.prefills:  # decodes alone: their tables as they are
            self._set_kernel_rows(meta, None, meta.decode_block_tables, meta.decode_context_lens)
            return
        # the kernel's fast path; with attention mass asked for, chunks go through SDPA, whose observed rows are
        # scored in torch, and the kernel rows are the decodes, a row a sequence
        in_place = self.ops is not None and self.dtype == torch.bfloat16 and meta.attention_mass is None
        rows = [torch.arange(meta.num_decodes, device=device)]
        tables, lens = [meta.decode_block_tables], [meta.decode_context_lens]
        meta.sdpa_chunks = []
        for chunk in meta.prefills:
            if (in_place and chunk.context_len > chunk.length and chunk.length <= IN_PLACE_MAX_CHUNK
                    and chunk.last_keys is None):  # (the kernel reads each row's own prefix)
                n = chunk.length
                rows.append(torch.arange(chunk.start, chunk.start + n, device=device))
                tables.append(chunk.block_table.unsqueeze(0).expand(n, -1))
                lens.append(torch.arange(chunk.context_len - n + 1, chunk.context_len + 1, device=device))
            else:
                meta.sdpa_chunks.append(self._sdpa_chunk(chunk, meta.window))
        if self.ops is None or (len(rows) == 1 and not meta.num_decodes):  # nothing for the kernel
            return
        width = max(t.shape[-1] for t in tables)
        # padding with block 0 is safe: the kernel reads no further than a row's context length
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tables]
        flat_rows = torch.cat(rows)
        contiguous = bool((flat_rows == torch.arange(len(flat_rows), device=device)).all())
        self._set_kernel_rows(meta, None if contiguous else flat_rows, torch.cat(padded), torch.cat(lens))

    def _all_kernel_rows(self, meta: AttentionMetadata) -> None:
        """Every token of the step a kernel row: the decodes, then each chunk's tokens, in the flat order."""
        assert meta.attention_mass is None, "kv_eviction: h2o is refused with batch_invariant (config.py)"
        device = meta.slot_mapping.device
        tables, lens = [meta.decode_block_tables], [meta.decode_context_lens]
        for chunk in meta.prefills:
            n = chunk.length
            tables.append(chunk.block_table.unsqueeze(0).expand(n, -1))
            lens.append(torch.arange(chunk.context_len - n + 1, chunk.context_len + 1, device=device))
        width = max(t.shape[-1] for t in tables)
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tables]
        meta.sdpa_chunks = []
        all_lens = torch.cat(lens)
        meta.kernel_rows = KernelRows(None, torch.cat(padded), all_lens, window_starts=meta.window_starts(all_lens))

    def _sdpa_chunk(self, chunk: PrefillChunk, window: Window | None) -> SdpaChunk:
        """How SDPA attends a prefill chunk: to this step's k, v when the chunk is its sequence's whole context,
        else to its cached context from the block its first query's window starts in."""
        device = chunk.block_table.device
        if chunk.context_len == chunk.length:
            within = window is None or window.first_key(chunk.length - 1) == 0  # then causal is the whole mask
            pos = torch.arange(chunk.length, device=device)
            plain = within and chunk.last_keys is None
            return SdpaChunk(chunk, None if plain else window_mask(pos, pos, window, chunk.last_keys))
        query_pos = torch.arange(chunk.context_len - chunk.length, chunk.context_len, device=device)
        first_key = 0 if window is None else window.first_key(chunk.context_len - chunk.length)
        first_block = first_key // self.block_size
        width = (chunk.block_table.shape[0] - first_block) * self.block_size
        key_pos = torch.arange(first_block * self.block_size, first_block * self.block_size + width, device=device)
        return SdpaChunk(chunk, window_mask(query_pos, key_pos, window, chunk.last_keys), first_block)

    def _set_kernel_rows(self, meta: AttentionMetadata, rows: torch.Tensor | None, tables: torch.Tensor,
                         lens: torch.Tensor) -> None:
        if meta.window is not None:  # a window reads a few blocks per row: nothing worth a cascade
            meta.kernel_rows = KernelRows(rows, tables, lens, window_starts=meta.window_starts(lens))
            return
        prefixes = []
        if self.cascade and meta.attention_mass is None:  # a prefix attended in torch would earn its blocks no mass
            prefixes, tables, lens = cascade.split_shared_prefixes(tables, lens, self.block_size)
        meta.kernel_rows = KernelRows(rows, tables, lens, prefixes)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.ops is None:
            decoded = self._decode(layer, q[:meta.num_decodes], meta, sinks) if meta.num_decodes else None
        else:
            decoded = (self._kernel_rows(layer, q, meta.kernel_rows, meta.attention_mass, sinks)
                       if meta.kernel_rows is not None else None)
        if not meta.prefills:
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            rows = meta.kernel_rows.rows if self.ops is not None else None
            if rows is None:
                out[:decoded.shape[0]] = decoded
            else:
                out[rows] = decoded
        self._attend_chunks(layer, q, k, v, meta, out, sinks)
        return out

    def _attend_chunks(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                       out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        """The step's SDPA chunks, each into its rows of `out`; with attention mass asked for (a row per sequence,
        the chunks' after the decodes'), the attention mass of each chunk's observed rows added to its row."""
        mass = None if meta.attention_mass is None else meta.attention_mass[meta.num_decodes:]
        for i, sdpa in enumerate(meta.sdpa_chunks):
            chunk, mask = sdpa.chunk, sdpa.mask
            rows = slice(chunk.start, chunk.start + chunk.length)
            if sdpa.first_block is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [H, n, d]
            else:
                keys, values = self._context(layer, chunk.block_table[sdpa.first_block:], meta)  # [H, L, d]
            if sinks is not None:  # SDPA has no extra logit: the scores made here
                out[rows] = sink_attention(q[rows], keys, values, mask, self.scale, sinks)
            else:
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                    attn_mask=mask, is_causal=mask is None and meta.causal, scale=self.scale, enable_gqa=True,
                )
                out[rows] = o[0].transpose(0, 1)
            if mass is not None:
                observed = min(chunk.length, OBSERVED_ROWS)
                own = torch.arange(chunk.length, device=q.device)  # causal: only the observed rows' mask is made
                visible = mask[-observed:] if mask is not None else window_mask(own[-observed:], own, None)
                first = sdpa.first_block or 0
                received = block_mass(q[rows][-observed:], keys, visible, self.scale, self.block_size)
                mass[i, first:first + received.shape[0]] += received

    def _kernel_rows(self, layer: int, q: torch.Tensor, kernel: KernelRows,
                     mass: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The decode kernel over every in-place row; each reads the blocks up to its own context length.
        Rows in a shared prefix read only their suffix there; the prefix, attended once for all of them,
        merges in. mass: the step's attention mass, whose first rows are these rows' (no shared prefixes then)."""
        rows = q[:kernel.context_lens.shape[0]] if kernel.rows is None else q[kernel.rows]
        out, lse = self.ops.paged_decode(rows, self.k_cache[layer], self.v_cache[layer], kernel.block_tables,
                                         kernel.context_lens, self.scale, kernel.window_starts,
                                         None if mass is None else mass[:rows.shape[0]])
        for prefix in kernel.shared_prefixes:
            keys, values = self.gather(layer, prefix.block_ids)  # [kv_heads, P, d]
            prefix_out, prefix_lse = cascade.shared_prefix_attention(rows[prefix.rows], keys, values, self.scale)
            self.ops.merge_attention_(out, lse, prefix.rows, prefix_out, prefix_lse)
        if sinks is not None:
            sink_correction_(out, lse, sinks)
        return out

    def _context(self, layer: int, block_table: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the blocks a step's rows read, as gather() returns them (a backend that keeps some of a step's
        rows outside its blocks overlays them)."""
        return self.gather(layer, block_table)

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Without the kernel. q: [B, heads, d], one new token per sequence -> [B, heads, d]."""
        b, heads, d = q.shape
        k, v = self._context(layer, meta.decode_block_tables, meta)  # [H, B, L, d]
        kv_heads = k.shape[0]
        group = heads // kv_heads
        if sinks is not None:  # SDPA has no extra logit: each sequence's scores made here
            o = torch.cat([sink_attention(q[i:i + 1], k[:, i], v[:, i], meta.decode_mask[0, i], self.scale, sinks)
                           for i in range(b)]).view(b, kv_heads, group, d).transpose(0, 1)
        else:
            qd = q.view(b, kv_heads, group, d).transpose(0, 1)  # [H, B, G, d]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        if meta.attention_mass is not None:  # the decodes' rows come first
            received = block_mass(q.unsqueeze(1), k, meta.decode_mask[0], self.scale, self.block_size)
            meta.attention_mass[:b, :received.shape[1]] += received
        return o.transpose(0, 1).reshape(b, heads, d)
