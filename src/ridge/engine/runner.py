"""A scheduled step -> flat tensors -> model forward -> logits of the sequences that sample."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from types import ModuleType

import torch

from ridge.attention import (
    AttentionMetadata,
    CudaBackend,
    LatentBackend,
    PrefillChunk,
    QuantizedKVBackend,
    make_backend,
)
from ridge.attention.quantized_kv import KEY_CENTER_POSITIONS
from ridge.cluster.shards import cut_heads
from ridge.config import EngineConfig
from ridge.engine.cuda_graphs import DecodeGraphs
from ridge.engine.prompt_logprobs import PromptRows, rows_to_score
from ridge.engine.scheduler import ScheduledStep
from ridge.engine.sequence import Sequence
from ridge.kernels import decode_stack
from ridge.kv.formats import KVFormat
from ridge.kv.layout import Window
from ridge.kv.state_cache import StateCache, StateStep
from ridge.lora.apply import NO_ADAPTER, AdapterSet, AdapterStep
from ridge.lora.request import LoRARequest
from ridge.models.moe import attach_fused_experts
from ridge.models.transformer import DecoderModel
from ridge.models.vision import ImageStep
from ridge.multimodal.placement import PlacedImage

log = logging.getLogger("ridge")


@dataclass
class StepInputs:
    """A scheduled step flattened for the model, its attention metadata prepared by the backend."""

    input_ids: torch.Tensor  # [T]: every scheduled token of every sequence, drafts after their sequence's own
    positions: torch.Tensor  # [T]
    meta: list[AttentionMetadata]  # one per KV group
    sample_rows: list[int]  # rows of the step whose logits get sampled
    samplers: list[Sequence]  # the sequences those rows belong to, in order
    prompt_rows: list[int]  # rows that score prompt tokens (prompt logprobs), in the order of `scored`
    scored: list[PromptRows]
    states: StateStep | None = None  # the sequences' state slots, for a model with state-space layers
    adapters: AdapterStep | None = None  # each row's LoRA adapter, where a sequence of the step has one
    # each sampler whose whole prompt is in the step: (its first row, its rows), for mean and CLS pooling
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)
    images: ImageStep | None = None  # a vision model's step with image tokens: their embeddings, M-RoPE positions


@dataclass
class StepLogits:
    """What a step's forward pass hands to sampling."""

    logits: torch.Tensor | None  # float32 [rows, V]: each sampler's row (1 + its drafts' rows), in order
    samplers: list[Sequence]
    scored: list[PromptRows]  # prompt rows to score, and their final hidden states (prompt_hidden) in order
    prompt_hidden: torch.Tensor | None = None
    attention_mass: torch.Tensor | None = None  # with h2o eviction: AttentionMetadata.attention_mass, a row a sequence
    hidden: torch.Tensor | None = None  # a pooling runner's, in place of logits: the samplers' final hidden states


class ModelRunner:
    def __init__(
        self, model: DecoderModel, backend_name: str, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: str, cpu_ops: ModuleType | None = None, enforce_eager: bool = False, batch_invariant: bool = False,
        max_batch: int = 1, max_model_len: int | None = None, scores_prompts: bool = True, num_state_slots: int = 0,
        kv_format: KVFormat | None = None, tensor_parallel: bool = False, attention_mass: bool = False,
        num_snapshots: int = 0, adapters: AdapterSet | None = None, pooling: str | None = None,
    ) -> None:
        """max_batch, max_model_len: the decode steps CUDA graphs are captured for (not with enforce_eager);
        scores_prompts: whether sequences asking for prompt logprobs get their prompt rows (a drafter's not);
        num_state_slots: the slots of sequences that run at once, for a model with state-space layers (their
        recurrent state) or a kv_format with tails (their last block's rows), and num_snapshots state snapshots'
        slots after them (kv/state_snapshots.py); tensor_parallel: the model is one rank's shard, its layers
        all-reducing between them (cluster/); attention_mass: each step reports the attention its sequences' blocks
        received (h2o eviction); adapters: the LoRA adapters over the model's projections, which steps whose sequences
        use them add (lora/apply.py); pooling: a step hands over each sampler's prompt pooled ("last": its last
        token's final hidden state; "mean": their mean over its tokens; "cls": its first token's), not logits (a
        pooling runner: embeddings; no CUDA graphs, which end in logits; mean and CLS pool whole prompts, which the
        scheduler's whole_prompts gives them)."""
        cfg = model.cfg
        self.adapters = adapters
        self.scores_prompts = scores_prompts
        self.pooling = pooling
        self.attention_mass = attention_mass
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        layout = cfg.kv_layout()
        self.windows = [group.window for group in layout.groups]
        self.backend = make_backend(cfg, backend_name, num_blocks, block_size, dtype, device, kv_format,
                                    num_state_slots)
        if cfg.attention_sinks and not self.backend.handles_sinks:
            raise ValueError(f"{cfg.architecture}: its attention sinks have no path in {type(self.backend).__name__} "
                             "(CUDA's Triton kernels); run it on the CPU")
        self.tails = kv_format is not None and kv_format.tail  # the backend reads each sequence's slot
        self.backend.ops = cpu_ops
        self.backend.batch_invariant = batch_invariant
        if isinstance(self.backend, QuantizedKVBackend):
            self.backend.set_key_centers(model.key_centers(min(max_model_len or cfg.max_position_embeddings,
                                                               KEY_CENTER_POSITIONS)))
        self.states = (StateCache(cfg.ssm_layers, num_state_slots + num_snapshots, cfg.ssm_conv_channels,
                                  cfg.ssm_conv_kernel, cfg.ssm_num_heads, cfg.ssm_head_dim, cfg.ssm_state_size, device)
                       if cfg.ssm_layers else None)
        # decode steps' layers in one C++ call where the model's layers all have a kernel there (a tensor-parallel
        # rank's calling the group's all-reduces between them)
        if not enforce_eager and cpu_ops is not None and self.device.type == "cpu" and cfg.num_experts:
            decode_stack.attach_native_experts(model, cpu_ops)  # the stack takes the same ones
        # (a pooling runner's steps are prompts: no decode step to fuse)
        self.decode_stack = None if enforce_eager or pooling is not None else decode_stack.build(
            model, self.backend, cpu_ops, tensor_parallel, self.states)
        self.graphs: DecodeGraphs | None = None
        fused_experts = False
        if self.device.type == "cuda" and cfg.num_experts and not tensor_parallel:
            fused_experts = attach_fused_experts(model)
        graphs = (self.device.type == "cuda" and isinstance(self.backend, (CudaBackend, LatentBackend))
                  and not enforce_eager and not tensor_parallel and pooling is None)
        if graphs and cfg.num_experts and not fused_experts:
            log.warning("ridge: no CUDA graphs for a mixture of experts whose experts run one matmul each (their "
                        "routing is read on the host each step); decode runs eagerly")
        elif graphs and cfg.ssm_layers:
            log.warning("ridge: no CUDA graphs for state-space layers yet; decode runs eagerly")
        elif graphs and kv_format is not None:
            log.warning("ridge: no CUDA graphs for a quantized KV cache yet (its write finds a step's blocks on the "
                        "host); decode runs eagerly")
        elif graphs:
            self.graphs = DecodeGraphs(model, self.backend, self.windows, block_size, max_batch,
                                       max_model_len or cfg.max_position_embeddings, self.device)
            self.graphs.capture()

    @classmethod
    def for_engine(cls, config: EngineConfig, model: DecoderModel, cpu_ops: ModuleType | None, num_blocks: int,
                   max_model_len: int, num_state_slots: int, num_snapshots: int = 0,
                   adapters: AdapterSet | None = None, pooling: str | None = None) -> ModelRunner:
        """The engine's runner of its (target) model, as config asks for it; pooling: a pooling runner's (the
        engine's pooling_type for the model)."""
        return cls(model, config.attention_backend, num_blocks, config.block_size, config.torch_dtype, config.device,
                   cpu_ops=cpu_ops, enforce_eager=config.enforce_eager, batch_invariant=config.batch_invariant,
                   max_batch=config.max_num_seqs, max_model_len=max_model_len, num_state_slots=num_state_slots,
                   kv_format=config.kv_format, tensor_parallel=config.tensor_parallel_size > 1,
                   attention_mass=config.eviction is not None and config.eviction.needs_attention_mass,
                   num_snapshots=num_snapshots, adapters=adapters, pooling=pooling)

    def close(self) -> None:
        """Nothing to release: the runner's tensors go with it (a tensor-parallel runner stops its ranks)."""

    # LoRA adapters (lora/apply.py): here, one process's; a tensor-parallel runner has every rank follow
    def load_adapter(self, request: LoRARequest) -> int:
        return self.adapters.index(request)

    def unload_adapter(self, name: str, in_use: set[int]) -> None:
        self.adapters.unload(name, in_use)

    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> StepLogits:
        """Run the step; return logits for the sequences that reach their last token, and those: one row
        each, or 1 + len(draft_ids) rows for a sequence whose drafts are checked in this pass (a sequence's
        draft tokens follow its own in the step, so row i scores draft i); and the hidden states of the
        rows that score prompt tokens."""
        # CUDA graphs hold no adapter's products
        adapted = self.adapters is not None and any(seq.adapter is not None for seq in step.seqs)
        if self.graphs is not None and not adapted and self.graphs.serves(step):
            return StepLogits(self.graphs.run(step), list(step.seqs), [])
        return self.run(self.prepare(step))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> StepLogits:
        """The forward pass of a prepared step (prepare(), or describe() and then prepare_backend())."""
        meta = inputs.meta
        mass = meta[0].attention_mass if meta else None  # a pure state-space model has no KV group
        states = inputs.states
        if states is not None:
            states = dataclasses.replace(states, cache=self.states)
            if states.fresh is not None:
                self.states.zero_(states.fresh)
            if states.restores is not None:
                self.states.copy_(states.restores)
        if self.adapters is not None:
            self.adapters.run_with(inputs.adapters)
        try:
            return self._forward(inputs, meta, states, mass)
        finally:
            if self.adapters is not None:
                self.adapters.run_with(None)

    def _forward(self, inputs: StepInputs, meta: list[AttentionMetadata], states: StateStep | None,
                 mass: torch.Tensor | None) -> StepLogits:
        # the fused decode stack has no adapter path: a step with adapters runs layer by layer
        if self.decode_stack is not None and inputs.adapters is None and self.decode_stack.serves(meta, states):
            sampled = self.decode_stack(inputs.input_ids, self.model.embed(inputs.input_ids), inputs.positions, meta,
                                        states)
            scored, prompt_hidden = [], None
        else:
            num_sampled = len(inputs.sample_rows)
            read = inputs.sample_rows + inputs.prompt_rows + self._pooled_rows(inputs.prompt_spans)
            rows = torch.tensor(read, dtype=torch.long, device=self.device)
            hidden = self.model.hidden_states(inputs.input_ids, inputs.positions, self.backend, meta, rows, states,
                                              inputs.images)
            sampled = hidden[:num_sampled]
            prompts = num_sampled + len(inputs.prompt_rows)
            scored = inputs.scored
            prompt_hidden = hidden[num_sampled:prompts] if inputs.prompt_rows else None
        if self.pooling is not None:
            pooled = sampled if self.pooling == "last" else self._pool(inputs, hidden[prompts:])
            if self.model.classifier is not None:  # a classifier's pooled output: its labels' logits
                pooled = self.model.classifier(pooled.to(hidden.dtype)).float()
            logits = StepLogits(None, inputs.samplers, scored, prompt_hidden, mass, hidden=pooled)
        else:
            logits = StepLogits(self.model.compute_logits(sampled), inputs.samplers, scored, prompt_hidden, mass)
        if states is not None and states.saves is not None:
            self.states.copy_(states.saves)
        return logits

    def _pooled_rows(self, prompt_spans: list[tuple[int, int]]) -> list[int]:
        """The rows mean or CLS pooling reads beyond the sampled ones: every row of each sampler's prompt (mean), or
        its first (cls); each sampler's prompt is whole in the step (the scheduler's whole_prompts)."""
        if self.pooling == "mean":
            return [row for first, count in prompt_spans for row in range(first, first + count)]
        return [first for first, _ in prompt_spans] if self.pooling == "cls" else []

    def _pool(self, inputs: StepInputs, pooled_rows: torch.Tensor) -> torch.Tensor:
        """Each sampler's pooled state [samplers, hidden] from its _pooled_rows' final hidden states."""
        if self.pooling == "cls":
            return pooled_rows
        counts = [count for _, count in inputs.prompt_spans]
        return torch.stack([rows.float().mean(0) for rows in pooled_rows.split(counts)])

    @torch.inference_mode()
    def score(self, token_ids: list[int], tables: list[list[int]], state_slot: int | None = None,
              adapter: int | None = None) -> torch.Tensor:
        """Float32 logits [T, V] at every position of token_ids, run as one prefill into `tables` (scratch
        blocks of every KV group) and `state_slot` (a scratch slot, for state-space layers or KV tails), which the
        caller holds: no sequence's state is read or changed. adapter: the LoRA adapter's index in self.adapters."""
        meta = [AttentionMetadata.whole_prompt(len(token_ids), table, self.block_size, window, self.device,
                                               self.model.cfg.causal)
                for table, window in zip(tables, self.windows, strict=True)]
        for m in meta:
            if self.tails:
                m.tail_slots = torch.tensor([state_slot], dtype=torch.long, device=self.device)
            self.backend.prepare(m)
        states = None
        if self.states is not None:
            slots = torch.tensor([state_slot], dtype=torch.long, device=self.device)
            self.states.zero_(slots)
            states = StateStep(self.states, slots, 0, [(0, len(token_ids))])
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        if adapter is not None:
            self.adapters.run_with(AdapterStep.of(torch.full_like(input_ids, adapter)))
        try:
            return self.model(input_ids, torch.arange(len(token_ids), device=self.device), self.backend, meta,
                              states=states)
        finally:
            if adapter is not None:
                self.adapters.run_with(None)

    # blocks moved between engines (engine/kv_transfer.py): one rank's cache, a list of one (TensorParallelRunner's
    # hold a list per rank)
    def read_blocks(self, blocks: torch.Tensor) -> list[list[torch.Tensor]]:
        return [self.backend.read_blocks(blocks)]

    def takes_blocks(self, shapes: list[list[tuple[tuple[int, ...], torch.dtype]]]) -> bool:
        return len(shapes) == 1 and self.backend.takes_blocks(shapes[0])

    def write_blocks(self, blocks: torch.Tensor, data: list[torch.Tensor], shards: list[range] | None) -> None:
        """Whole blocks (every KV head), this process's part of them as `shards` cut it (cluster/shards.py)."""
        self.backend.write_blocks(blocks, cut_heads(data, shards, 1)[0])

    def prepare(self, step: ScheduledStep) -> StepInputs:
        """The step's tokens, positions and slots as flat tensors; the backend's per-step work done."""
        inputs = self.describe(step)
        self.prepare_backend(inputs.meta)
        return inputs

    def prepare_backend(self, meta: list[AttentionMetadata]) -> None:
        for group_meta in meta:
            self.backend.prepare(group_meta)

    def describe(self, step: ScheduledStep) -> StepInputs:
        """The step's tokens, positions and slots as flat tensors, before the backend's per-step work: what another
        tensor-parallel rank needs to run the same step (engine/tensor_parallel.py)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        prompt_rows: list[int] = []
        scored: list[PromptRows] = []
        prompt_spans: list[tuple[int, int]] = []
        for seq, n in zip(step.seqs, step.num_tokens, strict=True):
            start, end = seq.num_computed, seq.num_computed + n
            tokens = seq.token_ids + seq.draft_ids if seq.draft_ids else seq.token_ids
            if self.scores_prompts and (rows := rows_to_score(seq, start, end)) is not None:
                first_row = len(input_ids) + rows.first_token - 1 - start  # the row at position first_token - 1
                prompt_rows.extend(range(first_row, first_row + rows.count))
                scored.append(rows)
            input_ids.extend(tokens[start:end])
            # (a prompt's tokens after its last image, and every later one, turn at their index plus rope_delta)
            positions.extend(range(start + seq.rope_delta, end + seq.rope_delta))
            if end == len(tokens):
                rows = 1 + len(seq.draft_ids)
                sample_rows.extend(range(len(input_ids) - rows, len(input_ids)))
                samplers.append(seq)
                if start == 0:
                    prompt_spans.append((len(input_ids) - n, n))
        if self.pooling in ("mean", "cls") and len(prompt_spans) != len(samplers):
            raise AssertionError(f"{self.pooling} pooling reads whole prompts (the scheduler's whole_prompts)")
        meta = [self._group_metadata(step, group, window) for group, window in enumerate(self.windows)]
        as_long = {"dtype": torch.long, "device": self.device}
        positions_tensor = torch.tensor(positions, **as_long)
        return StepInputs(torch.tensor(input_ids, **as_long), positions_tensor, meta,
                          sample_rows, samplers, prompt_rows, scored, self._state_step(step),
                          self._adapter_step(step, sample_rows + prompt_rows + self._pooled_rows(prompt_spans)),
                          prompt_spans, self._image_step(step, positions_tensor))

    def _image_step(self, step: ScheduledStep, positions: torch.Tensor) -> ImageStep | None:
        """The step's image tokens (embeddings from the vision tower, each image's computed when a step first
        reaches it and dropped once its last token is computed) and every row's M-RoPE positions (where a prompt of
        the step has them): None where no sequence of the step computes a token of a prompt with images."""
        if self.model.visual is None:
            return None
        chunks, flat = [], 0
        for seq, n in zip(step.seqs, step.num_tokens, strict=True):
            if seq.images and seq.num_computed < seq.prompt_len:
                chunks.append((seq, flat, seq.num_computed, seq.num_computed + n))
            flat += n
        if not chunks:
            return None
        rope = (positions.expand(3, -1).clone() if any(seq.rope_positions is not None for seq, *_ in chunks)
                else None)
        rows: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        # (the samples of one request share their prompt's images: each image once)
        reached = {id(image): image for seq, _, start, end in chunks for image in seq.images
                   if image.embeddings is None and image.offset < end and image.end > start}
        self._embed_images(list(reached.values()))
        done = []
        for seq, first, start, end in chunks:
            if seq.rope_positions is not None:
                in_prompt = min(end, seq.prompt_len) - start
                rope[:, first:first + in_prompt] = seq.rope_positions[:, start:start + in_prompt]
            for image in seq.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo >= hi:
                    continue
                # the places of the span this chunk holds that read the tower's rows, and which rows they read
                places = image.places()
                held = (places >= lo - image.offset) & (places < hi - image.offset)
                rows.append(first + image.offset - start + places[held])
                pieces.append(image.embeddings[held.to(image.embeddings.device)])
                if hi == image.end:
                    done.append(image)
        for image in done:
            image.embeddings = None
        if not rows:
            levels = 1 + len(self.model.cfg.vision.deepstack_blocks)
            return ImageStep(torch.zeros(0, dtype=torch.long, device=self.device),
                             torch.zeros(0, levels, self.model.cfg.hidden_size, device=self.device), rope)
        return ImageStep(torch.cat(rows).to(self.device), torch.cat(pieces), rope)

    def _embed_images(self, images: list[PlacedImage]) -> None:
        """Run the vision tower over these images at once, each keeping its rows of the output."""
        if not images:
            return
        patches = torch.cat([image.image.patches for image in images]).to(self.device)
        out = self.model.visual(patches, [image.image.grid for image in images])
        for image, rows in zip(images, out.split([len(image.places()) for image in images]), strict=True):
            image.embeddings = rows

    def _adapter_step(self, step: ScheduledStep, read_rows: list[int]) -> AdapterStep | None:
        """Each row's adapter (a sequence's drafts are its rows too), where a sequence of the step has one."""
        if self.adapters is None or all(seq.adapter is None for seq in step.seqs):
            return None
        as_long = {"dtype": torch.long, "device": self.device}
        row_adapters = torch.tensor([NO_ADAPTER if seq.adapter is None else seq.adapter
                                     for seq, n in zip(step.seqs, step.num_tokens, strict=True) for _ in range(n)],
                                    **as_long)
        kept = torch.tensor(read_rows, **as_long) if self.model.cfg.kv_shared_layers else None
        return AdapterStep.of(row_adapters, kept)

    def _state_step(self, step: ScheduledStep) -> StateStep | None:
        """The step's state slots; those of sequences computing their first token to be zeroed (a new past), and the
        snapshots to restore before it and take after it, by run() in the cache of the runner that runs the step."""
        if self.states is None:
            return None
        as_long = {"dtype": torch.long, "device": self.device}
        slots = torch.tensor([seq.state_slot for seq in step.seqs], **as_long)
        fresh = [seq.state_slot for seq in step.seqs if seq.num_computed == 0]
        restores = [(seq.restore_from, seq.state_slot) for seq in step.seqs if seq.restore_from is not None]
        saves = [(seq.state_slot, seq.pending_snapshot[1]) for seq in step.seqs if seq.pending_snapshot is not None]
        chunks, flat = [], 0
        for i, n in enumerate(step.num_tokens):
            if i >= step.num_decodes:
                chunks.append((flat, n))
            flat += n
        return StateStep(None, slots, step.num_decodes, chunks, torch.tensor(fresh, **as_long) if fresh else None,
                         torch.tensor(restores, **as_long) if restores else None,
                         torch.tensor(saves, **as_long) if saves else None)

    def _last_keys(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """The last key (cache index) each of seq's next n tokens sees where one of them sees past itself: a token
        of a span that attends both ways sees to the span's end (which the chunk holds: KVManager.chunk_end)."""
        start = seq.num_computed
        overlapping = [(max(lo, start), min(hi, start + n), hi) for lo, hi in seq.bidirectional_spans
                       if lo < start + n and hi > start]
        if not overlapping:
            return None
        last = torch.arange(start, start + n)
        for lo, hi, stop in overlapping:
            last[lo - start:hi - start] = stop - 1
        return (last - seq.num_evicted).to(self.device)

    def _group_metadata(self, step: ScheduledStep, group: int, window: Window | None) -> AttentionMetadata:
        """One KV group's slots and block tables for the step."""
        bs = self.block_size
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        flat = 0
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens, strict=True)):
            # cache indexes: the positions less the evicted ones before them (kv/eviction.py)
            start, end = seq.num_computed - seq.num_evicted, seq.num_computed - seq.num_evicted + n
            table = seq.block_tables[group]
            if i >= step.num_decodes:
                prefills.append(PrefillChunk(flat, n, end, torch.tensor(table[: -(-end // bs)], device=self.device),
                                             self._last_keys(seq, n)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            flat += n
        decodes = step.seqs[: step.num_decodes]
        width = max((len(s.block_tables[group]) for s in decodes), default=1)
        tables = [s.block_tables[group] + [0] * (width - len(s.block_tables[group])) for s in decodes]
        as_long = {"dtype": torch.long, "device": self.device}
        mass = None
        if self.attention_mass:  # a row a sequence, as wide as the longest table
            mass = torch.zeros(len(step.seqs), max(len(s.block_tables[group]) for s in step.seqs), device=self.device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, **as_long),
            num_decodes=step.num_decodes,
            decode_block_tables=torch.tensor(tables, **as_long).view(len(decodes), width),
            decode_context_lens=torch.tensor([s.num_computed - s.num_evicted + 1 for s in decodes], **as_long),
            prefills=prefills,
            window=window,
            attention_mass=mass,
            tail_slots=torch.tensor([s.state_slot for s in step.seqs], **as_long) if self.tails else None,
            causal=self.model.cfg.causal,
        )
