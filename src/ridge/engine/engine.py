"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler.

A step is schedule -> execute -> sample -> update (the scheduler's), and reports what it added to each
request as RequestDeltas; text, stop strings and whole outputs are the output processor's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch

from ridge.cluster.shards import ShardPlan
from ridge.config import EngineConfig, ModelConfig
from ridge.engine import prompt_logprobs
from ridge.engine.drafters import Drafter, DraftModelDrafter, NgramDrafter
from ridge.engine.limits import RequestLimits
from ridge.engine.loading import ModelFile, load_weights, reads_its_part, shard_plan
from ridge.engine.outputs import AdapterUse, RequestDelta, SampleDelta, StepError, StepStats
from ridge.engine.runner import ModelRunner
from ridge.engine.sampler import Sampler, bad_word_ids
from ridge.engine.scheduler import Sampled, ScheduledStep, Scheduler, StopRule, check_priority
from ridge.engine.sequence import Sequence
from ridge.engine.speculative import SpeculationPolicy, speculable, verify
from ridge.engine.structured import GrammarCompiler
from ridge.engine.tensor_parallel import Build, Ranks, TensorParallelRunner
from ridge.kernels import cpu_ops
from ridge.kv.block_pool import BlockPool
from ridge.kv.manager import KVManager
from ridge.lora.apply import AdapterSet
from ridge.lora.request import LoRARequest
from ridge.models.loader import LoadedModel
from ridge.models.mmproj import projector_processing
from ridge.multimodal.images import ImageProcessing
from ridge.multimodal.placement import ImagePrompt, ImageReader
from ridge.sampling_params import SamplingParams

log = logging.getLogger("ridge")


def load_adapters(config: EngineConfig, loaded: LoadedModel, plan: ShardPlan | None) -> AdapterSet:
    """The LoRA adapters' set over a loaded model (a rank's shard, under `plan`), lora_modules' loaded now in their
    order, which every rank follows (a bad one stops the start)."""
    adapters = AdapterSet(loaded.model, loaded.config, config.torch_dtype, config.device, config.max_lora_rank, plan)
    for request in LoRARequest.from_modules(config.lora_modules):
        adapters.index(request)
    if not config.enforce_eager and (plan is None or plan.rank == 0):
        log.warning("ridge: steps whose sequences use a LoRA adapter run layer by layer, without the fused decode "
                    "step%s", " or CUDA graphs" if config.device.startswith("cuda") else "")
    return adapters


def sequence_slot_bytes(cfg: ModelConfig, config: EngineConfig) -> int:
    """What a running sequence holds outside the KV blocks: its recurrent state and its KV tail (int2)."""
    tails = config.kv_format is not None and config.kv_format.tail and cfg.attention_layers
    return cfg.ssm_state_bytes() + (cfg.kv_tail_bytes(config.torch_dtype, config.block_size) if tails else 0)


def kv_memory_split(cfg: ModelConfig, config: EngineConfig, snapshots: bool = False) -> tuple[int, int, int]:
    """kv_cache_memory as (KV blocks, sequence slots, state snapshots). A running sequence holds a slot where the
    model has state-space layers (its recurrent state) or the cache keeps tails (int2: the rows of the block it is
    filling), so slots bound how many run at once: max_num_seqs of them where they fit in half the memory (all of it
    without attention layers), as many as fit otherwise. snapshots: prefix caching keeps copies of states
    (kv/state_snapshots.py): config.state_snapshots of them, or by default as many as the slots where they fit in a
    quarter of the memory left (all of it without attention layers). The blocks take the rest."""
    budget = config.kv_cache_bytes
    slot_bytes = sequence_slot_bytes(cfg, config)
    slots = 0
    if slot_bytes:
        share = budget // 2 if cfg.attention_layers else budget
        slots = min(config.max_num_seqs, share // slot_bytes)
        if slots < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes holds no sequence slot of this model "
                             f"({slot_bytes} bytes a sequence{' in half of it' if share < budget else ''})")
        budget -= slots * slot_bytes
    num_snapshots = 0
    if snapshots:
        state_bytes = cfg.ssm_state_bytes()
        share = budget // 4 if cfg.attention_layers else budget
        num_snapshots = min(slots, share // state_bytes) if config.state_snapshots is None else config.state_snapshots
        if num_snapshots * state_bytes > budget:
            raise ValueError(f"state_snapshots: {num_snapshots} of {state_bytes} bytes each do not fit in the "
                             f"{budget} bytes of kv_cache_memory left after the sequence slots; ask for fewer or give "
                             "it more memory")
        budget -= num_snapshots * state_bytes
    if not cfg.attention_layers:
        return 0, slots, num_snapshots
    per_block = cfg.kv_bytes_per_block(config.torch_dtype, config.block_size, config.kv_format)
    return budget // per_block, slots, num_snapshots


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        torch.set_num_threads(config.threads_per_process())
        torch.manual_seed(config.seed)  # the generator of samples without a seed of their own
        target = ModelFile.open(config.model, config.mmproj)
        self.pooling = target.pooling_for(config)  # None: it generates
        plan = shard_plan(config, target, rank=0)  # the split checked before any weight is read
        self.tokenizer = target.tokenizer
        draft_file = self._open_draft_model() if config.speculate == "draft" else None  # before any load
        kernels = cpu_ops.load() if config.cpu_kernels and config.device == "cpu" else None
        if config.batch_invariant and kernels is None:
            raise ValueError("batch_invariant: needs ridge's CPU kernels, which did not build here (see the warning "
                             "above)")
        # ranks that read only their part of the file load side by side with this one; the others start once this
        # one has loaded, so that two whole models (made whole to be quantized at load) are never held at once
        ranks = Ranks.meet(config) if reads_its_part(config) else None
        try:
            pool = self._build(config, target, plan, draft_file, kernels, progress)
            if plan is not None:
                ranks = ranks or Ranks.meet(config)
                self.runner = ranks.start(plan, self.runner, pool)
        except BaseException:
            if ranks is not None:  # the group met: the others stop (after their load, if still loading)
                ranks.abort()
            raise
        # how this engine reads a vision model's images, for the callers that prepare a request's (None: no vision)
        self.images = self._image_reader(target)

    def _build(self, config: EngineConfig, target: ModelFile, plan: ShardPlan | None, draft_file: ModelFile | None,
               kernels: ModuleType | None, progress: bool) -> Build:
        """The engine's model (rank 0's part of it under tensor parallelism), its pool, scheduler and runner; the
        pool's size, as the other ranks make theirs."""
        self.loaded: LoadedModel = load_weights(target, config, kernels, progress, plan)
        cfg = self.loaded.config
        if cfg.ssm_layers and config.speculate:
            raise ValueError("speculate: state-space layers cannot take back rejected draft tokens (their state has "
                             "no earlier versions); run this model without speculative decoding")
        prefix_caching = config.enable_prefix_caching
        # mean and CLS pooling read every token of a prompt, and an encoder's tokens attend to the later ones: its
        # prompts are computed whole (the scheduler's whole_prompts), and none from a cached prefix, whose states
        # would be skipped (an encoder's: computed without the tokens after it)
        whole_prompts = self.pooling in ("mean", "cls") or not cfg.causal
        if whole_prompts and prefix_caching:
            log.warning("ridge: prefix caching is off: %s computes every prompt whole (%s)", target.path.name,
                        "an encoder" if not cfg.causal else f"{self.pooling} pooling")
            prefix_caching = False
        if config.state_snapshots is not None and not cfg.ssm_layers:
            raise ValueError("state_snapshots: keeps states of state-space layers, which this model has none of; "
                             "leave it out")
        if cfg.ssm_layers and prefix_caching and config.eviction is not None:
            if config.state_snapshots is not None:
                raise ValueError(f"state_snapshots: prefix caching is off for a state-space model under "
                                 f"kv_eviction={config.kv_eviction} (a snapshot of the state would summarise tokens "
                                 "whose KV was evicted); leave one of them out")
            log.warning("ridge: prefix caching is off for a model with state-space layers under KV eviction (a "
                        "snapshot of the state would summarise tokens whose KV was evicted)")
            prefix_caching = False
        # under tensor parallelism, each rank's pool holds its own KV heads: as many blocks as the rank with the
        # most of them fits in kv_cache_memory
        kv_cfg = cfg if plan is None else plan.pool_config(cfg)
        per_block = kv_cfg.kv_bytes_per_block(config.torch_dtype, config.block_size, config.kv_format)
        num_blocks, num_state_slots, num_snapshots = kv_memory_split(kv_cfg, config,
                                                                     snapshots=prefix_caching and bool(cfg.ssm_layers))
        if cfg.ssm_layers and prefix_caching and not num_snapshots:
            log.warning("ridge: prefix caching is off: no room for a snapshot of the recurrent state "
                        "(state_snapshots=0), without which a cached prefix cannot be resumed")
            prefix_caching = False
        layout = cfg.kv_layout()
        if layout.groups and num_blocks < 1 + layout.has_windows:  # a layout with windows holds one null block
            raise ValueError(
                f"kv_cache_memory: {config.kv_cache_bytes} bytes holds no KV block ({per_block} bytes each)"
            )
        if config.eviction is not None and (layout.has_windows or not layout.groups):
            raise ValueError(f"kv_eviction: {config.kv_eviction} on a model with "
                             f"{'sliding-window layers' if layout.groups else 'no attention layers'} is not supported "
                             "(eviction runs on full-attention caches)")
        if config.eviction is not None and cfg.index_topk:
            raise ValueError(f"kv_eviction: {config.kv_eviction} on a model with sparse attention (index_topk="
                             f"{cfg.index_topk}) is not supported: its indexer already chooses the keys a query "
                             "reads")
        self.kv = KVManager(num_blocks, config.block_size, prefix_caching, layout, num_state_slots=num_state_slots,
                            eviction=config.eviction, num_snapshots=num_snapshots)
        positions = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        pool_tokens = self.kv.max_sequence_tokens(config.max_num_batched_tokens, positions)
        if pool_tokens < config.block_size:
            raise ValueError(f"kv_cache_memory: {num_blocks} KV blocks of {per_block} bytes cannot hold one sequence "
                             f"computed in chunks of max_num_batched_tokens={config.max_num_batched_tokens} (each "
                             "sliding-window layer group holds its window and a chunk, an evicting cache its "
                             "kv_budget and a chunk); give it more memory")
        self.max_model_len = min(positions, pool_tokens)
        if whole_prompts and config.max_num_batched_tokens < self.max_model_len:
            log.warning("ridge: max_model_len %d cut to max_num_batched_tokens (%d): a pooled prompt is computed in "
                        "one step; raise --max-num-batched-tokens for longer ones", self.max_model_len,
                        config.max_num_batched_tokens)
            self.max_model_len = config.max_num_batched_tokens
        self.limits = RequestLimits(self.max_model_len, cfg.vocab_size)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.schedule_policy,
                                   StopRule(frozenset(self.tokenizer.stop_token_ids), self.max_model_len),
                                   config.max_loras if config.enable_lora else None, whole_prompts)
        self.adapters = load_adapters(config, self.loaded, plan) if config.enable_lora else None
        self.runner: ModelRunner | TensorParallelRunner = ModelRunner.for_engine(
            config, self.loaded.model, kernels, num_blocks, self.max_model_len, num_state_slots, num_snapshots,
            self.adapters, self.pooling)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size)
        self.sampler = Sampler(cfg.vocab_size, self.tokenizer.stop_token_ids, self.grammars)
        self.drafter = self._make_drafter(draft_file, num_blocks, kernels, progress)
        self.speculation: SpeculationPolicy | None = None
        self.set_speculation(config.speculation_policy if self.drafter is not None else None)
        self._requests: dict[str, _Request] = {}
        self._aborted: set[str] = set()  # aborted since the last step: reported by the next one
        self._scheduled: ScheduledStep | None = None  # the batch of the step running now
        self.last_step = StepStats()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        log.info("ridge: %s, %s, %d KV blocks of %d tokens (%.0f MiB, %s)", target.path.name,
                 self.loaded.weight_format, num_blocks, config.block_size, num_blocks * per_block / 2**20,
                 config.kv_cache_dtype if config.kv_format else f"{str(config.torch_dtype).removeprefix('torch.')}")
        if num_state_slots:
            log.info("ridge: %d sequence slots (recurrent state, KV tails) of %.1f MiB: at most %d sequences run at "
                     "once", num_state_slots, sequence_slot_bytes(kv_cfg, config) / 2**20, num_state_slots)
        if num_snapshots:
            log.info("ridge: prefix caching keeps up to %d snapshots of a sequence's recurrent state (%.1f MiB each)",
                     num_snapshots, kv_cfg.ssm_state_bytes() / 2**20)
        return Build(num_blocks, num_state_slots, self.max_model_len, num_snapshots, self.pooling)

    def _open_draft_model(self) -> ModelFile:
        """The draft model's file, refused before any weights load when its vocabulary is not the target's."""
        draft = ModelFile.open(self.config.draft_model)
        if draft.tokenizer.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(f"draft_model: its vocabulary ({draft.tokenizer.vocab_size} tokens) differs from the "
                             f"target's ({self.tokenizer.vocab_size}); a drafter must share the tokenizer")
        return draft

    def _make_drafter(self, draft_model: ModelFile | None, num_blocks: int,
                      kernels: ModuleType | None, progress: bool) -> Drafter | None:
        config = self.config
        if config.speculate == "ngram":
            return NgramDrafter()
        if draft_model is None:
            return None
        draft = load_weights(draft_model, config, kernels, progress)
        if draft.config.ssm_layers:
            raise ValueError("draft_model: a drafter with state-space layers cannot take back rejected tokens")
        runner = ModelRunner(draft.model, config.attention_backend, num_blocks, config.block_size,
                             config.torch_dtype, config.device, cpu_ops=kernels,
                             enforce_eager=config.enforce_eager, max_batch=config.max_num_seqs,
                             max_model_len=self.max_model_len, scores_prompts=False)
        sampler = Sampler(draft.config.vocab_size, self.tokenizer.stop_token_ids)
        log.info("ridge: draft model %s, %s", draft_model.path.name, draft.weight_format)
        # as many blocks as the target's pool: a drafter never holds more tokens than its target
        kv = KVManager(num_blocks, config.block_size, layout=draft.config.kv_layout(),
                       rewind_margin=config.num_speculative_tokens + 1)
        return DraftModelDrafter(runner, kv, sampler, config.max_num_batched_tokens)

    def set_speculation(self, policy: str | None, num_speculative_tokens: int | None = None) -> None:
        """Speculate with the loaded drafter under `policy` ("fixed" or "adaptive"), or not at all (None):
        benchmarks compare the modes on one engine, the same weights in the same memory."""
        if policy is None:
            self.speculation = None
            return
        if self.drafter is None:
            raise ValueError("speculate: this engine was built without a drafter (speculate / draft_model)")
        k = num_speculative_tokens or self.config.num_speculative_tokens
        self.speculation = SpeculationPolicy(k, adaptive=policy == "adaptive")

    @property
    def labels(self) -> tuple[str, ...]:
        """A sequence classifier's labels, by index (its pooled outputs are their logits); () for any other model."""
        cfg = self.loaded.config
        return (self.loaded.spec.label_names or tuple(map(str, range(cfg.num_labels)))) if cfg.num_labels else ()

    @property
    def pool(self) -> BlockPool:
        """The KV manager's block pool, for metrics and checks (only the manager changes it)."""
        return self.kv.pool

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 embed: bool = False) -> None:
        self.limits.validate(prompt_token_ids, params, embed)
        if params is not None and params.structured_outputs is not None:
            self.grammars.grammar(params.structured_outputs)  # compiled and cached, or a ValueError naming it

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        validated: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        embed: bool = False,
        images: ImagePrompt | None = None,
    ) -> str:
        """Queue a request (a text, or its token ids) after validating it against self.limits, unless the
        caller did (the server, in its own process, with the same limits); return its id. lora_request: the
        adapter it runs with (loaded on first use); priority: under schedule_policy priority, lower goes first;
        embed: the prompt's embedding rather than a generation (runner pooling; params are not read); images: the
        prompt's images placed in it (self.images.place), whose token_ids are the prompt's."""
        self.config.check_request_kind(embed)
        params = SamplingParams(max_tokens=1) if embed else params or SamplingParams()
        ids = self.tokenizer.encode_prompt(prompt)
        if images is not None and (embed or ids != images.token_ids):
            raise ValueError("images: an embedding reads no images" if embed else
                             "images: placed in another prompt (the prompt is the placed images' token_ids)")
        if not validated:
            self.validate(ids, params, embed)
        spans = self._bidirectional_spans(images)
        check_priority(self.config.schedule_policy, priority)
        adapter = self._adapter(lora_request)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        banned = bad_word_ids(params.bad_words, partial(self.tokenizer.encode, add_special_tokens=False)) \
            if params.bad_words else []
        seqs = []
        for i in range(params.n):
            generator = (torch.Generator(device=self.config.device).manual_seed(params.seed + i)  # on the device:
                         if params.seed is not None else None)  # the same seed gives the same tokens there
            grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i, prompt_len=len(ids),
                           token_ids=list(ids), params=params, generator=generator, grammar=grammar,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else [],
                           bad_word_ids=banned, adapter=adapter, priority=priority)
            if images is not None:  # the samples share the images (their tower output is computed once)
                seq.images, seq.rope_positions, seq.rope_delta = images.images, images.rope_positions, images.rope_delta
                seq.bidirectional_spans = spans
            if arrival_time is not None:  # the time the caller received it, before any queue in between
                seq.timings.arrival = arrival_time
            seqs.append(seq)
        self._requests[request_id] = _Request(request_id, seqs)
        self.scheduler.add(seqs)
        return request_id

    def _bidirectional_spans(self, images: ImagePrompt | None) -> list[tuple[int, int]]:
        """A prompt's spans whose tokens attend both ways (Gemma 3's images: each image's tokens); each must fit one
        step, which computes it whole."""
        vision = self.loaded.config.vision
        if images is None or vision is None or not vision.bidirectional:
            return []
        spans = []
        for image in images.images:
            places = image.places()
            spans.append((image.offset + int(places[0]), image.offset + int(places[-1]) + 1))
        longest, budget = max((end - start for start, end in spans), default=0), self.config.max_num_batched_tokens
        if longest > budget:
            raise ValueError(f"images: an image's {longest} tokens, computed in one step, are over "
                             f"max_num_batched_tokens ({budget})")
        return spans

    def _image_reader(self, target: ModelFile) -> ImageReader | None:
        """How requests' images reach this engine's vision model (its preprocessor_config.json, or its projector
        file's header); None without one."""
        cfg, config = self.loaded.config, self.config
        if cfg.vision is None:
            return None
        refused = "a draft model" if config.speculate == "draft" else None  # (the drafter's positions are its own)
        processing = (projector_processing(target.projector.gguf, cfg.vision) if target.projector is not None
                      else ImageProcessing.of_model(target.path, cfg.vision))
        if cfg.vision.bidirectional and config.batch_invariant and refused is None:
            refused = "batch_invariant (its kernel reads each token's own prefix; an image's tokens see all of it)"
        if cfg.vision.family == "siglip":  # Gemma 3's: "\n\n<start_of_image>", the image, "<end_of_image>\n\n"
            newlines = tuple(self.tokenizer.encode("\n\n", add_special_tokens=False))
            return ImageReader(processing, cfg.image_token_id, cfg.vision.merge_size, refused,
                               placeholder_id=cfg.vision.start_token_id,
                               before=(*newlines, cfg.vision.start_token_id),
                               after=(cfg.vision.end_token_id, *newlines))
        if cfg.vision.family != "pixtral":
            return ImageReader(processing, cfg.image_token_id, cfg.vision.merge_size, refused)
        # Mistral 3's rows of image tokens end in these (its tokenizer's special tokens, as HF's processor names them)
        marks = {name: self.tokenizer.tokenizer.token_to_id(name) for name in ("[IMG_BREAK]", "[IMG_END]")}
        missing = [name for name, token in marks.items() if token is None]
        if missing and refused is None:  # the model serves text; a request's images are refused, saying why
            refused = f"this tokenizer: it has no {' / '.join(missing)} token (Mistral 3's image layout)"
        return ImageReader(processing, cfg.image_token_id, cfg.vision.merge_size, refused, marks["[IMG_BREAK]"],
                           marks["[IMG_END]"])

    def adapter_use(self) -> AdapterUse | None:
        """The adapters running and waiting sequences use (None without enable_lora)."""
        if self.adapters is None:
            return None

        def names(seqs: Iterable[Sequence]) -> list[str]:
            used = sorted({seq.adapter for seq in seqs if seq.adapter is not None})
            return [adapter.request.lora_name for i in used if (adapter := self.adapters.adapters[i]) is not None]

        return AdapterUse(names(self.scheduler.running), names(self.scheduler.waiting), self.config.max_loras)

    def load_adapter(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter now (a server's runtime loading), or ValueError naming what does not fit."""
        self._adapter(lora_request)

    def unload_adapter(self, name: str) -> None:
        """Unload a LoRA adapter no request uses, or ValueError naming why not."""
        if self.adapters is None:
            raise ValueError("lora_name: this engine was started without enable_lora")
        in_use = {seq.adapter for request in self._requests.values() for seq in request.seqs if not seq.finished}
        self.runner.unload_adapter(name, in_use)

    def _adapter(self, lora_request: LoRARequest | None) -> int | None:
        """The adapter's index in self.adapters (loaded on first use); None for the base model."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise ValueError(f"lora_request: {lora_request.lora_name!r} asked for, but this engine was started "
                             "without enable_lora")
        known = self.adapters.known(lora_request)
        return known if known is not None else self.runner.load_adapter(lora_request)  # on every rank

    def sequences(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request (one per sample)."""
        return self._requests[request_id].seqs

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or only its sample `index`) and free its KV blocks; unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished and index in (None, seq.index):
                self.scheduler.finish(seq, "abort")
        self._aborted.add(request_id)

    @property
    def has_unfinished(self) -> bool:
        """Work to step, or aborted requests whose final delta the next step() still has to hand out."""
        return self.scheduler.has_work or bool(self._aborted)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduled step; return a delta for every request that progressed or finished.

        A step that raises ends the requests it was running (their blocks freed, their outputs never
        reported) and raises StepError naming them; every other request is untouched and the engine can
        step on. A failure before the step's batch was chosen ends every running request. A step after
        which the engine is idle checks that no KV block leaked (the whole accounting with debug_kv_checks).
        """
        self._scheduled = None
        try:
            deltas = self._step()
        except Exception as exc:
            seqs = self._scheduled.seqs if self._scheduled is not None else list(self.scheduler.running)
            request_ids = sorted({s.request_id for s in seqs if s.request_id in self._requests})
            for request_id in request_ids:
                for seq in self._requests.pop(request_id).seqs:
                    if not seq.finished:
                        self.scheduler.finish(seq, "abort")
            self._aborted -= set(request_ids)
            if self.drafter is not None:
                self.drafter.release_finished()
            raise StepError(request_ids, f"{type(exc).__name__}: {exc}") from exc
        if self.config.debug_kv_checks and not self.has_unfinished:
            self.check_integrity()
        elif not self.has_unfinished:  # going idle: every block must be back (an AssertionError otherwise)
            self.kv.check_idle(full=False)
        return deltas

    def _step(self) -> list[RequestDelta]:
        cache = self.kv.cache.stats if self.kv.cache is not None else None
        before = (cache.queries, cache.hits, cache.evictions) if cache else (0, 0, 0)
        stats = self.last_step = StepStats()
        if self.speculation is not None:
            self._draft()
        step = self._scheduled = self.scheduler.schedule()
        chunks = zip(step.seqs[step.num_decodes:], step.num_tokens[step.num_decodes:], strict=True)
        stats.prefill_tokens = sum(n for s, n in chunks if not s.draft_ids)  # not decodes with drafts
        stats.preemptions = step.num_preempted
        if cache:
            stats.prefix_cache_queries, stats.prefix_cache_hits = cache.queries - before[0], cache.hits - before[1]
        if step.empty:
            return self._report([])
        started = time.perf_counter()
        out = self.runner.execute(step)
        if out.attention_mass is not None:  # before the scheduler commits the step (and evicts by it)
            self.kv.record_attention(step.seqs, out.attention_mass)
        if self.speculation is not None and not stats.prefill_tokens:
            # decoding steps only: a prefill chunk's tokens cost less each than a decode's or a draft's
            self.speculation.target_cost.add(step.total_tokens, time.perf_counter() - started)
        if out.scored:
            prompt_logprobs.record(out.scored, out.prompt_hidden, self.loaded.model.compute_logits)
        samplers = out.samplers
        if out.hidden is not None:  # a pooling runner: each sampler's prompt is whole, its embedding pooled
            self.scheduler.update(step, [])
            self._embed(samplers, out.hidden)
        else:
            stats.sampled_tokens = self.scheduler.update(step, self._sample(out.logits, samplers))
        if self.drafter is not None:
            self.drafter.release_finished()
        if cache:
            stats.prefix_cache_evictions = cache.evictions - before[2]
        return self._report(samplers)

    def _embed(self, samplers: list[Sequence], hidden: torch.Tensor) -> None:
        """End each sequence that computed its prompt's last token with its embedding: its prompt's final hidden
        states pooled (the runner's pooling), L2-normalized in float32; a classifier's, its labels' logits."""
        embeddings = (hidden.float() if self.loaded.config.num_labels
                      else torch.nn.functional.normalize(hidden.float(), dim=-1)).cpu()
        now = time.perf_counter()
        for seq, embedding in zip(samplers, embeddings, strict=True):
            seq.embedding = embedding.tolist()
            seq.timings.first_token = now
            self.scheduler.finish(seq, "stop")

    def _sample(self, logits: torch.Tensor, samplers: list[Sequence]) -> list[Sampled]:
        """The next token of each sequence that computed its last token; a row block per sequence with drafts."""
        rows = list(itertools.accumulate((1 + len(s.draft_ids) for s in samplers), initial=0))
        plain = [i for i, s in enumerate(samplers) if not s.draft_ids]
        results: list[Sampled] = []
        if plain:
            # every row plain (no drafts): the logits as they are, not a gathered copy
            plain_logits = logits if len(plain) == logits.shape[0] else logits[[rows[i] for i in plain]]
            result = self.sampler(plain_logits, [samplers[i] for i in plain])
            for i, token, logprobs in zip(plain, result.tokens, result.logprobs, strict=True):
                results.append(Sampled(samplers[i], [token], None if logprobs is None else [logprobs]))
                if samplers[i].grammar is not None:
                    samplers[i].grammar.accept([token])
        drafted = [i for i, s in enumerate(samplers) if s.draft_ids]
        blocks = {i: logits[rows[i]:rows[i + 1]] for i in drafted}  # the rows that check each sequence's drafts
        constrained = [i for i in drafted if samplers[i].grammar is not None]
        if constrained:  # each checking row keeps the tokens its grammar allows after the drafts before it
            masks = self.grammars.draft_masks([(samplers[i].grammar, samplers[i].draft_ids) for i in constrained])
            masks = masks.to(logits.device).logical_not_()
            start = 0
            for i in constrained:
                end = start + blocks[i].shape[0]
                blocks[i] = blocks[i].masked_fill(masks[start:end, :logits.shape[1]], float("-inf"))
                start = end
        for i in drafted:
            seq = samplers[i]
            emitted = self._verify(seq, blocks[i])
            results.append(Sampled(seq, emitted))
            if seq.grammar is not None:
                seq.grammar.accept(emitted)
        return results

    def _draft(self) -> None:
        """Drafts for this step's decodes, k of them as the policy says (each within its request's limits)."""
        decoding = [s for s in self.scheduler.running if s.num_pending == 1]
        k = self.speculation.choose(len(decoding))
        if k == 0:
            return
        seqs, room = [], []
        for seq in decoding:
            if speculable(seq.params) and seq.num_outputs >= seq.params.min_tokens:
                # verifying j drafts can emit j + 1 tokens: stay within max_tokens and the context
                fits = min(k, seq.params.max_tokens - seq.num_outputs - 1, self.max_model_len - len(seq.token_ids) - 1)
                if fits > 0:
                    seqs.append(seq)
                    room.append(fits)
        if not seqs:
            return
        self.drafter.catch_up(seqs)
        started = time.perf_counter()
        for seq, draft in zip(seqs, self.drafter.propose(seqs, room), strict=True):
            keep = len(draft.tokens) if seq.grammar is None else seq.grammar.valid_prefix(draft.tokens)
            seq.draft_ids = draft.tokens[:keep]  # a grammar's target would refuse the rest: not worth scoring
            seq.draft_probs = draft.probs[:keep] if draft.probs is not None and keep else None
        self.speculation.draft_cost.add(len(seqs), (time.perf_counter() - started) / k)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """Check seq's drafts against the target's rows: the accepted drafts and the target's next token."""
        view = [seq] * logits.shape[0]
        greedy = seq.params.greedy
        target = self.sampler.bias(logits, view) if greedy else self.sampler.probabilities(logits, view)
        drafted = len(seq.draft_ids)
        emitted = verify(target, seq.draft_ids, seq.draft_probs, greedy, seq.generator)
        accepted = len(emitted) - 1
        seq.speculation.num_drafts += 1
        seq.speculation.num_draft_tokens += drafted
        seq.speculation.num_accepted_tokens += accepted
        self.last_step.spec_drafts += 1
        self.last_step.spec_draft_tokens += drafted
        self.last_step.spec_accepted_tokens += accepted
        if self.speculation is not None:
            self.speculation.observe_verification(drafted, accepted)
        return emitted

    def prompt_logits(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> torch.Tensor:
        """Float32 logits [T, V] at every position of token_ids (row i predicts token i + 1), with lora_request's
        adapter where given.

        Runs as one prefill on scratch blocks of the pool; no request state changes. For reference
        checks and perplexity.
        """
        self.validate(token_ids)
        adapter = self._adapter(lora_request)
        with self.kv.scratch(len(token_ids)) as (blocks, state_slot):
            return self.runner.score(token_ids, blocks, state_slot, adapter)

    # ---- outputs --------------------------------------------------------------------------------
    def _report(self, progressed: list[Sequence]) -> list[RequestDelta]:
        ids = {s.request_id for s in progressed}
        ids |= self._aborted  # the only requests that can finish without a step touching them
        self._aborted = set()
        deltas = [self._delta(self._requests[i]) for i in ids if i in self._requests]
        for delta in deltas:
            if delta.finished:
                del self._requests[delta.request_id]
        return deltas

    def _delta(self, request: _Request) -> RequestDelta:
        """What the request's samples gained since the last report: only the new tokens are copied."""
        samples = []
        for s in request.seqs:
            start = s.prompt_len + s.num_reported
            logprobs = s.logprobs[s.num_reported:] if s.params.logprobs is not None else None
            samples.append(SampleDelta(s.index, s.token_ids[start:], logprobs, s.finish_reason, s.stop_reason))
            s.num_reported = s.num_outputs
        metrics = request.seqs[0].timings.summary()
        metrics["num_preemptions"] = sum(s.num_preemptions for s in request.seqs)
        if self.config.eviction is not None:
            metrics["kv_evicted_tokens"] = sum(s.max_evicted for s in request.seqs)
        if self.drafter is not None:
            metrics["spec_draft_tokens"] = sum(s.speculation.num_draft_tokens for s in request.seqs)
            metrics["spec_accepted_tokens"] = sum(s.speculation.num_accepted_tokens for s in request.seqs)
            metrics["spec_drafts"] = sum(s.speculation.num_drafts for s in request.seqs)
        first = request.seqs[0]
        scored = None  # the prompt's logprobs, in the first delta after its last token was scored
        if first.params.prompt_logprobs is not None and not request.prompt_logprobs_sent and not first.scores_prompt:
            scored, request.prompt_logprobs_sent = first.prompt_logprobs, True
        return RequestDelta(request.request_id, samples, request.finished, metrics, first.num_cached_tokens, scored,
                            first.embedding)

    def close(self) -> None:
        """Stop what the engine started beside itself (tensor-parallel ranks); the engine cannot step after."""
        self.runner.close()

    def check_integrity(self) -> None:
        """Assert the KV accounting holds; when idle, every block is free (or parked in the prefix cache)."""
        self.scheduler.check_integrity()
        idle = not self.has_unfinished
        if self.drafter is not None:
            self.drafter.check_integrity(idle=idle)
        if idle:
            self.kv.check_idle()
