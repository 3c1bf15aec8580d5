"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once at start.

A decode step of a large model launches some ten kernels per layer; run eagerly, the GPU waits on Python
for each, and at batch 1 it idles most of the step. A graph replays the whole forward pass as one launch.
It reads its inputs from persistent buffers (token ids, positions, and per KV group the slots, block
tables and context lengths), so a step copies its inputs into them and replays the graph of the smallest
bucket that holds its batch (vLLM's scheme). Rows past the batch are padding: slot -1 (written nowhere),
context length 1 (they read one key of block 0); their logits are dropped. Block tables are as wide as
max_model_len, so any decode step of up to the largest bucket's rows fits; a larger batch, or a step with
prefills or drafts, runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ridge.attention.backend import AttentionBackend, AttentionMetadata
from ridge.engine.scheduler import ScheduledStep
from ridge.kv.layout import Window
from ridge.models.transformer import DecoderModel

log = logging.getLogger("ridge")

BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))  # vLLM's capture sizes up to 256


class DecodeGraphs:
    def __init__(self, model: DecoderModel, backend: AttentionBackend, windows: list[Window | None], block_size: int,
                 max_batch: int, max_model_len: int, device: torch.device) -> None:
        self.model, self.backend, self.windows, self.block_size = model, backend, windows, block_size
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [min(max_batch, BATCH_BUCKETS[-1])]
        rows, width = self.buckets[-1], -(-max_model_len // block_size)
        as_long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(rows, **as_long)
        self.positions = torch.zeros(rows, **as_long)
        self.slots = [torch.full((rows,), -1, **as_long) for _ in windows]
        self.tables = [torch.zeros(rows, width, **as_long) for _ in windows]
        self.context_lens = [torch.ones(rows, **as_long) for _ in windows]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per bucket, largest first, all in one memory pool (a smaller batch's activations fit in
        the largest's)."""
        started = time.perf_counter()
        pool = None
        for batch in reversed(self.buckets):
            args = (self.input_ids[:batch], self.positions[:batch], self.backend, self._metadata(batch))
            side = torch.cuda.Stream()  # warm-up off the capture stream: Triton compiles, cuBLAS picks kernels
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(*args)
            pool = graph.pool()
            self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()
        log.info("ridge: captured CUDA graphs of decode steps for %d batch sizes up to %d in %.1f s",
                 len(self.buckets), self.max_batch, time.perf_counter() - started)

    def _metadata(self, batch: int) -> list[AttentionMetadata]:
        meta = [AttentionMetadata(slot_mapping=slots[:batch], num_decodes=batch, decode_block_tables=tables[:batch],
                                  decode_context_lens=lens[:batch], prefills=[], window=window)
                for slots, tables, lens, window in zip(self.slots, self.tables, self.context_lens, self.windows,
                                                       strict=True)]
        for m in meta:
            self.backend.prepare(m)
        return meta

    def serves(self, step: ScheduledStep) -> bool:
        """A step of decodes alone, one token each, of at most the largest bucket's rows."""
        return (step.num_decodes == len(step.seqs) <= self.max_batch
                and step.total_tokens == step.num_decodes)

    def run(self, step: ScheduledStep) -> torch.Tensor:
        """The step's float32 logits [B, vocab] (a view into the graph's output: read before the next step)."""
        batch = len(step.seqs)
        bucket = next(b for b in self.buckets if b >= batch)
        bs = self.block_size
        positions = np.array([seq.num_computed for seq in step.seqs], dtype=np.int64)
        ids = np.array([seq.token_ids[seq.num_computed] for seq in step.seqs], dtype=np.int64)
        self.input_ids[:batch].copy_(torch.from_numpy(ids), non_blocking=True)
        rotary = positions
        if self.model.visual is not None:  # after a prompt's images a token turns at its index plus rope_delta
            rotary = positions + np.array([seq.rope_delta for seq in step.seqs], dtype=np.int64)
        self.positions[:batch].copy_(torch.from_numpy(rotary), non_blocking=True)
        for group, (slots, tables, lens) in enumerate(zip(self.slots, self.tables, self.context_lens, strict=True)):
            rows = np.zeros((bucket, tables.shape[1]), dtype=np.int64)
            for i, seq in enumerate(step.seqs):
                table = seq.block_tables[group]
                rows[i, :len(table)] = table
            slot_values = np.full(bucket, -1, dtype=np.int64)
            slot_values[:batch] = rows[np.arange(batch), positions // bs] * bs + positions % bs
            len_values = np.ones(bucket, dtype=np.int64)
            len_values[:batch] = positions + 1
            slots[:bucket].copy_(torch.from_numpy(slot_values), non_blocking=True)
            tables[:bucket].copy_(torch.from_numpy(rows), non_blocking=True)
            lens[:bucket].copy_(torch.from_numpy(len_values), non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch]
