"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ridge.config import EngineConfig
from ridge.engine.drafters import Drafter, DraftModelDrafter, NgramDrafter
from ridge.engine.runner import ModelRunner
from ridge.engine.sampler import Sampler
from ridge.engine.scheduler import ScheduledStep, Scheduler
from ridge.engine.sequence import Sequence, Status
from ridge.engine.speculative import SpeculationPolicy, speculable, verify
from ridge.hub import resolve
from ridge.kernels import batch_invariance, cpu_ops, dense_linear, onednn_linear
from ridge.kv.block_pool import BlockPool
from ridge.kv.prefix_cache import PrefixCache
from ridge.models.gguf_file import GGUFFile
from ridge.models.loader import LoadedModel, load_model, open_gguf
from ridge.quant.calibration import (
    CALIBRATION_WINDOW,
    awq_layerwise,
    calibration_windows,
    input_importance,
    quantize_layerwise,
    windows_for,
)
from ridge.quant.linear import (
    CALIBRATED,
    METHODS,
    quantize_model,
    quantize_weight,
    share_prompt_scratch,
    use_int8_activations,
)
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import OutputText, RidgeTokenizer

log = logging.getLogger("ridge")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float | None] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class StepError(RuntimeError):
    """A step raised; the requests it was running (`request_ids`) have ended, the engine can go on."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids, self.message = request_ids, message


@dataclass
class StepStats:
    """What the last step() did, for metrics."""

    prefill_tokens: int = 0  # prompt (or recomputed) tokens whose K/V it computed
    sampled_tokens: int = 0  # tokens appended to outputs (more than one per sequence when drafts are accepted)
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found
    prefix_cache_evictions: int = 0  # cached blocks dropped for room
    spec_drafts: int = 0  # sequences whose drafts the target checked
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of an engine; checked wherever the request arrives, the engine's process or not."""

    max_model_len: int
    vocab_size: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise ValueError, naming the field and the limit, for a request the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty (0 tokens)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leaves no room to generate; the maximum context "
                f"length is {self.max_model_len} tokens (prompt + at least 1 new token)"
            )
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if params is None:
            return
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k: {params.top_k} is more than the vocabulary's {vocab} tokens; -1 or 0 means all")


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    # n > 1 with prefix caching: samples 1.. wait here until sample 0 has prefilled the prompt, then find
    # every full prompt block in the cache and compute only the last, partial one
    held: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass
class ModelFile:
    """A model's file or directory, opened: its GGUF header parsed once (for tokenizer and weights), its
    tokenizer read, no weights loaded yet."""

    path: Path
    gguf: GGUFFile | None
    tokenizer: RidgeTokenizer

    @classmethod
    def open(cls, model: str) -> ModelFile:
        path = resolve(model)
        gguf = open_gguf(path) if path.is_file() else None
        return cls(path, gguf, RidgeTokenizer.from_path(path, gguf))


class LLMEngine:
    """detokenize=False leaves outputs' text empty and stop strings unchecked: the caller (the server's
    process) does both from the token ids, off the step loop."""

    def __init__(self, config: EngineConfig, progress: bool = True, detokenize: bool = True) -> None:
        self.config = config
        self.detokenize = detokenize
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        target = ModelFile.open(config.model)
        self.tokenizer = target.tokenizer
        draft_file = self._open_draft_model() if config.speculate == "draft" else None  # before any load
        kernels = cpu_ops.load() if config.cpu_kernels and config.device == "cpu" else None
        if config.batch_invariant and kernels is None:
            raise ValueError("batch_invariant: needs ridge's CPU kernels, which did not build here (see the warning "
                             "above)")
        self.loaded: LoadedModel = _load(target, config, kernels, progress)
        cfg = self.loaded.config
        per_block = cfg.kv_bytes_per_token(config.torch_dtype) * config.block_size
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {config.kv_cache_bytes} bytes holds no KV block ({per_block} bytes each)"
            )
        pool_tokens = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, pool_tokens,
                                 cfg.max_position_embeddings)
        self.limits = RequestLimits(self.max_model_len, cfg.vocab_size)
        self.pool = BlockPool(num_blocks, config.block_size,
                              PrefixCache() if config.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.schedule_policy)
        self.runner = ModelRunner(
            self.loaded.model, config.attention_backend, num_blocks, config.block_size, config.torch_dtype,
            config.device, cpu_ops=kernels, enforce_eager=config.enforce_eager,
            batch_invariant=config.batch_invariant,
        )
        self.sampler = Sampler(cfg.vocab_size, self.tokenizer.stop_token_ids)
        self.drafter = self._make_drafter(draft_file, num_blocks, kernels, progress)
        self.speculation: SpeculationPolicy | None = None
        self.set_speculation(config.speculation_policy if self.drafter is not None else None)
        self._requests: dict[str, _Request] = {}
        self._aborted: set[str] = set()  # aborted since the last step: reported by the next one
        self._scheduled: ScheduledStep | None = None  # the batch of the step running now
        self.last_step = StepStats()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        log.info("ridge: %s, %s, %d KV blocks of %d tokens (%.0f MiB)", target.path.name, self.loaded.weight_format,
                 num_blocks, config.block_size, num_blocks * per_block / 2**20)

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
        draft = _load(draft_model, config, kernels, progress)
        runner = ModelRunner(draft.model, config.attention_backend, num_blocks, config.block_size,
                             config.torch_dtype, config.device, cpu_ops=kernels,
                             enforce_eager=config.enforce_eager)
        sampler = Sampler(draft.config.vocab_size, self.tokenizer.stop_token_ids)
        log.info("ridge: draft model %s, %s", draft_model.path.name, draft.weight_format)
        # as many blocks as the target's pool: a drafter never holds more tokens than its target
        return DraftModelDrafter(runner, BlockPool(num_blocks, config.block_size), sampler,
                                 config.max_num_batched_tokens)

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

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        self.limits.validate(prompt_token_ids, params)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            if not prompt:
                raise ValueError("prompt: must not be empty (0 characters)")
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.validate(ids, params)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + i)
            seqs.append(Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i, prompt_len=len(ids),
                token_ids=list(ids), params=params,
                text=OutputText(self.tokenizer, params) if self.detokenize else None,
                generator=generator,
            ))
            if arrival_time is not None:  # the time the caller received it, before any queue in between
                seqs[-1].timings.arrival = arrival_time
        request = _Request(request_id, text, ids, seqs)
        if self.pool.cache is not None and len(seqs) > 1 and len(ids) > self.config.block_size:
            request.held = seqs[1:]
        self._requests[request_id] = request
        for s in seqs:
            if s not in request.held:
                self.scheduler.add(s)
        return request_id

    def sequences(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request (one per sample), e.g. to stream their text."""
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
        """Work to step, or aborted requests whose final output the next step() still has to hand out."""
        return self.scheduler.has_work or bool(self._aborted)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that progressed or finished.

        A step that raises ends the requests it was running (their blocks freed, their outputs never
        reported) and raises StepError naming them; every other request is untouched and the engine can
        step on. A failure before the step's batch was chosen ends every running request.
        """
        self._scheduled = None
        try:
            return self._step()
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

    def _step(self) -> list[RequestOutput]:
        cache = self.pool.cache.stats if self.pool.cache is not None else None
        before = (cache.queries, cache.hits, cache.evictions) if cache else (0, 0, 0)
        self.last_step = StepStats()
        if self.speculation is not None:
            self._draft()
        step = self._scheduled = self.scheduler.schedule()
        chunks = zip(step.seqs[step.num_decodes:], step.num_tokens[step.num_decodes:], strict=True)
        self.last_step.prefill_tokens = sum(n for s, n in chunks if not s.draft_ids)  # not decodes with drafts
        self.last_step.preemptions = step.num_preempted
        if cache:
            self.last_step.prefix_cache_queries = cache.queries - before[0]
            self.last_step.prefix_cache_hits = cache.hits - before[1]
        if step.empty:
            return self._collect([])
        started = time.perf_counter()
        logits, samplers = self.runner.execute(step)
        if self.speculation is not None and not self.last_step.prefill_tokens:
            # decoding steps only: a prefill chunk's tokens cost less each than a decode's or a draft's
            self.speculation.target_cost.add(step.total_tokens, time.perf_counter() - started)
        for seq, n in zip(step.seqs, step.num_tokens, strict=True):
            self.scheduler.advance(seq, n - len(seq.draft_ids))  # the drafts' K/V counts once accepted
        rows = list(itertools.accumulate((1 + len(s.draft_ids) for s in samplers), initial=0))
        plain = [i for i, s in enumerate(samplers) if not s.draft_ids]
        if plain:
            # every row plain (no drafts): the logits as they are, not a gathered copy
            plain_logits = logits if len(plain) == logits.shape[0] else logits[[rows[i] for i in plain]]
            result = self.sampler(plain_logits, [samplers[i] for i in plain])
            now = time.perf_counter()
            for i, token, logprobs in zip(plain, result.tokens, result.logprobs, strict=True):
                seq = samplers[i]
                if seq.timings.first_token is None:
                    seq.timings.first_token = now
                    self._release_held(seq)
                self._append(seq, token, logprobs)
        for i, seq in enumerate(samplers):
            if seq.draft_ids:
                self._verify(seq, logits[rows[i]:rows[i + 1]])
        if self.drafter is not None:
            self.drafter.release_finished()
        if cache:
            self.last_step.prefix_cache_evictions = cache.evictions - before[2]
        return self._collect(samplers)

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
            seq.draft_ids, seq.draft_probs = draft.tokens, draft.probs
        self.speculation.draft_cost.add(len(seqs), (time.perf_counter() - started) / k)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Check seq's drafts against the target's rows; append what is accepted and the target's next token."""
        view = [seq] * logits.shape[0]
        greedy = seq.params.greedy
        target = self.sampler.bias(logits, view) if greedy else self.sampler.probabilities(logits, view)
        drafted = len(seq.draft_ids)
        emitted = verify(target, seq.draft_ids, seq.draft_probs, greedy, seq.generator)
        accepted = len(emitted) - 1
        seq.draft_ids, seq.draft_probs = [], None
        seq.speculation.num_drafts += 1
        seq.speculation.num_draft_tokens += drafted
        seq.speculation.num_accepted_tokens += accepted
        self.last_step.spec_drafts += 1
        self.last_step.spec_draft_tokens += drafted
        self.last_step.spec_accepted_tokens += accepted
        if self.speculation is not None:
            self.speculation.observe_verification(drafted, accepted)
        for token in emitted:
            self._append(seq, token, None)
            if seq.finished:
                return
        self.scheduler.advance(seq, accepted)  # after the append: the cache hashes the tokens of full blocks
        self.scheduler.trim(seq)

    def _release_held(self, seq: Sequence) -> None:
        """seq's prompt is in the cache now: its held siblings go to the front of the queue."""
        request = self._requests[seq.request_id]
        if seq.index == 0 and request.held:
            for sibling in reversed(request.held):
                if not sibling.finished:
                    self.scheduler.waiting.appendleft(sibling)
            request.held = []

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [T, V] at every position of token_ids (row i predicts token i + 1).

        Runs as one prefill on blocks of its own, taken from and returned to the pool; no request state
        changes. For reference checks and perplexity.
        """
        self.validate(token_ids)
        blocks = self.pool.allocate(self.pool.blocks_for(len(token_ids)))
        seq = Sequence(seq_id=-1, request_id="", index=0, prompt_len=len(token_ids), token_ids=list(token_ids),
                       params=SamplingParams(), text=None, block_table=blocks)
        try:
            logits, _ = self.runner.execute(ScheduledStep([seq], [len(token_ids)], num_decodes=0), all_logits=True)
        finally:
            self.pool.release(blocks)
        return logits

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        params = seq.params
        seq.token_ids.append(token)
        self.last_step.sampled_tokens += 1
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        may_stop = seq.num_outputs >= params.min_tokens
        if may_stop and (token in (params.stop_token_ids or ())
                         or (not params.ignore_eos and token in self.tokenizer.stop_token_ids)):
            self.scheduler.finish(seq, "stop", token)
            return
        if seq.text is not None and (stop := seq.text.add(token, seq.num_outputs)) is not None:
            self.scheduler.finish(seq, "stop", stop)
            return
        if seq.num_outputs >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _collect(self, progressed: list[Sequence]) -> list[RequestOutput]:
        ids = {s.request_id for s in progressed}
        ids |= self._aborted  # the only requests that can finish without a step touching them
        self._aborted = set()
        outputs = [self._output(self._requests[i]) for i in ids if i in self._requests]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _output(self, request: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.output_text,
                token_ids=list(s.output_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            )
            for s in request.seqs
        ]
        first = request.seqs[0].timings
        metrics = first.summary()
        metrics["num_preemptions"] = sum(s.num_preemptions for s in request.seqs)
        if self.drafter is not None:
            metrics["spec_draft_tokens"] = sum(s.speculation.num_draft_tokens for s in request.seqs)
            metrics["spec_accepted_tokens"] = sum(s.speculation.num_accepted_tokens for s in request.seqs)
            metrics["spec_drafts"] = sum(s.speculation.num_drafts for s in request.seqs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, metrics, request.seqs[0].num_cached_tokens)

    def check_integrity(self) -> None:
        """Assert the KV accounting holds; when idle, every block is free."""
        self.scheduler.check_integrity()
        if self.drafter is not None:
            self.drafter.check_integrity(idle=not self.has_unfinished)
        if not self.has_unfinished:
            assert self.pool.num_free == self.pool.num_blocks, (
                f"{self.pool.num_blocks - self.pool.num_free} KV blocks leaked with no request running"
            )
        for seq in self.scheduler.running:
            assert seq.status is Status.RUNNING


def _load(model: ModelFile, config: EngineConfig, kernels: ModuleType | None, progress: bool) -> LoadedModel:
    """A model's weights in the engine's dtype, packed for the CPU's matmuls, on ridge's kernels."""
    native = config.quantization == "gguf"
    loaded = load_model(model.path, config.torch_dtype, config.device, progress, model.gguf, gguf_native=native,
                        ops=kernels)
    if config.quantization in METHODS:
        fitted = importance = None
        method, group_size = config.quantization, config.quantization_group_size
        num_windows = windows_for(method, config.calibration_windows)  # 0 for int4, plain RTN
        windows = calibration_windows(model.tokenizer, num_windows, CALIBRATION_WINDOW, progress) if num_windows else []
        if method in CALIBRATED:  # calibrated here, one decoder layer at a time
            if method == "awq":
                fitted = awq_layerwise(loaded.model, windows, group_size, integer_zeros=False, dtype=config.torch_dtype,
                                       device=config.device, progress=progress)
            else:
                fitted = quantize_layerwise(loaded.model, windows,
                                            lambda _key, w, h: quantize_weight(w, method, group_size, h),
                                            config.torch_dtype, config.device, progress)
        elif windows:  # int8 and fp8: each row's scale weighed by its columns' importance, in one pass
            importance = input_importance(loaded.model, windows, config.torch_dtype, config.device, progress)
        quantize_model(loaded.model, method, group_size, config.torch_dtype, fitted=fitted, importance=importance,
                       progress=progress, ops=kernels)
        loaded.weight_format += f" -> {config.quantization}" + (
            f" g{config.quantization_group_size}" if config.quantization not in ("int8", "fp8") else "")
    elif config.packed_linear and onednn_linear.available(config.torch_dtype, config.device):
        # natively quantized layers are left as they are; batch invariance keeps oneDNN off its single-row path
        onednn_linear.pack_linears(loaded.model, min_rows=2 if config.batch_invariant else 1)
    if config.int8_activations:
        if kernels is None or not use_int8_activations(loaded.model):
            raise ValueError("int8_activations: needs quantized weights (--quantization, or a quantized "
                             "checkpoint) and ridge's CPU kernels: built for AVX512-VNNI (float32 or bfloat16), "
                             "or for AVX2 (float32)")
        loaded.weight_format += ", int8 activations"
    if kernels is not None and config.torch_dtype == torch.float32:
        dense_linear.use_kernel(loaded.model, kernels, every_row=config.batch_invariant)  # the layers still dense
    packs = kernels is not None and onednn_linear.available(config.torch_dtype, config.device)
    if packs and (scratch_bytes := share_prompt_scratch(loaded.model.layers, kernels)):
        log.info("ridge: prompts multiply quantized weights on oneDNN's packed layout (%.0f MiB of scratch)",
                 scratch_bytes / 2**20)
    loaded.model.use_kernels(kernels)
    if config.batch_invariant:
        batch_invariance.verify(loaded.model, config.torch_dtype)
        loaded.weight_format += ", batch invariant"
    return loaded
