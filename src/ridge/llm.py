"""The offline Python API, shaped like vLLM's: LLM(model).generate(prompts, params) and LLM.chat()."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from ridge.config import EngineConfig
from ridge.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ridge.engine.engine import LLMEngine
from ridge.engine.output_processor import OutputProcessor
from ridge.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ridge.engine.scoring import ScorePlan, check_classifier, probabilities
from ridge.lora.request import LoRARequest
from ridge.multimodal.messages import prompt_images, split_images
from ridge.multimodal.placement import ImagePrompt
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import ChatOptions

Prompt = str | list[int] | dict[str, Any]  # a text, token ids, or vLLM's TextPrompt / TokensPrompt


class LLM:
    """LLM(model, **engine_args): model is an alias (`ridge pull` names), a .gguf file or an HF directory.

    Engine args are EngineConfig's fields: dtype, device, block_size, kv_cache_memory,
    max_num_batched_tokens, max_num_seqs, max_model_len, attention_backend, num_threads.
    """

    def __init__(self, model: str, progress: bool = True, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self.tokenizer = self.engine.tokenizer
        self.processor = OutputProcessor(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs come back in prompt order.

        A bad prompt raises ValueError naming the field, and the prompts queued before it are withdrawn.
        A list of ints is one tokenized prompt; a list of lists or strings is a batch. lora_request: the LoRA
        adapter all prompts run with, or one per prompt (None: the base model); the engine needs enable_lora.
        priority: all prompts', or one per prompt, lower first; the engine needs schedule_policy="priority".
        """
        batch = _as_batch(prompts)
        param_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(param_list) != len(batch):
            raise ValueError(f"params: got {len(param_list)} SamplingParams for {len(batch)} prompts")
        adapters = _per_prompt(lora_request, len(batch), "lora_request", "adapters")
        priorities = _per_prompt(priority, len(batch), "priority", "priorities")
        order: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, p, adapter, rank in zip(batch, param_list, adapters, priorities, strict=True):
                order.append(self._add(prompt, p, OutputKind.FINAL, adapter, rank))
            with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished:
                    for out in self._step():
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a bad prompt, a failed step, Ctrl-C: the batch's other requests give their blocks back
            self._abandon(order)
            raise
        return [done[i] for i in order]

    def _add(self, prompt: Prompt, params: SamplingParams, kind: OutputKind,
             lora_request: LoRARequest | None = None, priority: int = 0) -> str:
        """Validate and queue one prompt (the engine checks it); its outputs come from the processor."""
        prompt, sources = prompt_images(prompt)
        ids = self.tokenizer.encode_prompt(prompt)
        images = self._place_images(ids, sources) if sources else None
        if images is not None:
            ids = images.token_ids
        request_id = self.engine.add_request(ids, params, lora_request=lora_request, priority=priority,
                                             images=images)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        self.processor.add(request_id, text if isinstance(text, str) else None, ids, params, kind)
        return request_id

    def _place_images(self, ids: list[int], sources: list[Any]) -> ImagePrompt:
        if self.engine.images is None:
            raise ValueError(f"multi_modal_data: this model ({self.engine.loaded.config.architecture}) reads no "
                             "images; ridge runs the vision towers of Qwen2-VL and Qwen2.5-VL")
        return self.engine.images.place(ids, sources)

    def _step(self) -> list[RequestOutput]:
        """One engine step through the output processor; samples a stop string finished are aborted at once."""
        outputs, stopped = self.processor.process(self.engine.step())
        for request_id, index in stopped:
            self.engine.abort(request_id, index)
        return outputs

    def _abandon(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
            self.processor.trackers.pop(request_id, None)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              priority: int | Sequence[int] = 0) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order, as vLLM's LLM.embed: its final hidden states pooled as the
        engine pools (--pooling-type), L2-normalized (an engine started with runner="pooling"). The prompts batch
        as generate's do."""
        if self.engine.loaded.config.num_labels:
            raise ValueError("embed: this model is a classifier, whose outputs are its labels' logits; classify or "
                             "score with it")
        batch = [self.tokenizer.encode_prompt(p) for p in _as_batch(prompts)]
        return [EmbeddingRequestOutput(i, ids, EmbeddingOutput(vector))
                for i, ids, vector in self._pooled(batch, use_tqdm, lora_request, priority, "embed")]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] = 0) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities, as vLLM's LLM.classify: a sequence classifier's softmax over its labels
        (the sigmoid of a single label's logit)."""
        check_classifier(self.engine.loaded.config.num_labels, "classify")
        batch = [self.tokenizer.encode_prompt(p) for p in _as_batch(prompts)]
        return [ClassificationRequestOutput(i, ids, ClassificationOutput(probabilities(logits)))
                for i, ids, logits in self._pooled(batch, use_tqdm, lora_request, priority, "classify")]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = False,
              lora_request: LoRARequest | None = None, priority: int = 0) -> list[ScoringRequestOutput]:
        """How well each pair of texts goes together, as vLLM's LLM.score: text_1 against each of text_2 (or
        text_1[i] against text_2[i], lists of one length). A cross-encoder's score is the sigmoid of its logit for
        the pair read as one input; an embedding model's, the cosine similarity of the two texts' embeddings
        (engine/scoring.py)."""
        plan = ScorePlan.of(text_1, text_2, self.tokenizer, self.engine.loaded.config.num_labels)
        pooled = self._pooled(plan.prompts, use_tqdm, lora_request, priority, "score")
        scores = plan.scores([vector for _, _, vector in pooled])
        return [ScoringRequestOutput(str(i), plan.pair_ids(i), ScoringOutput(score)) for i, score in enumerate(scores)]

    def _pooled(self, batch: list[list[int]], use_tqdm: bool,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None, priority: int | Sequence[int],
                desc: str) -> list[tuple[str, list[int], list[float]]]:
        """Each prompt's pooled output (request id, its ids, the vector), in prompt order; the prompts batch as
        generate's do."""
        adapters = _per_prompt(lora_request, len(batch), "lora_request", "adapters")
        priorities = _per_prompt(priority, len(batch), "priority", "priorities")
        order: list[str] = []
        done: dict[str, list[float]] = {}
        try:
            for encoded, adapter, rank in zip(batch, adapters, priorities, strict=True):
                order.append(self.engine.add_request(encoded, lora_request=adapter, priority=rank, embed=True))
            with tqdm(total=len(order), desc=desc, unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished:
                    for delta in self.engine.step():
                        if delta.embedding is not None:
                            done[delta.request_id] = delta.embedding
                            bar.update(1)
        except BaseException:  # a bad prompt, a failed step, Ctrl-C: the batch's other requests give their blocks back
            self._abandon(order)
            raise
        return [(i, ids, done[i]) for i, ids in zip(order, batch, strict=True)]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first (see engine/beam_search.py)."""
        encoded = [self.tokenizer.encode_prompt(p) for p in _as_batch(prompts)]
        return beam_search(self.engine, encoded, params or BeamSearchParams(), lora_request, priority)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None, priority: int = 0) -> Iterator[str]:
        """Yield text deltas of one prompt as they are decoded (one sample: params.n must be 1)."""
        for delta in self.stream_outputs(prompt, params, lora_request, priority):
            if delta.text:
                yield delta.text

    def stream_outputs(self, prompt: Prompt, params: SamplingParams | None = None,
                       lora_request: LoRARequest | None = None, priority: int = 0) -> Iterator[CompletionOutput]:
        """Yield one prompt's sample as it is decoded: each step's new text and token ids (a CompletionOutput of
        deltas; one sample: params.n must be 1), the last with its finish_reason."""
        if params is not None and params.n != 1:
            raise ValueError(f"n must be 1 when streaming, got {params.n}")
        request_id = self._add(prompt, params or SamplingParams(), OutputKind.DELTA, lora_request, priority)
        finished = False
        try:
            while not finished:
                for out in self._step():
                    if out.request_id == request_id:
                        finished = out.finished
                        if out.outputs:
                            yield out.outputs[0]
        finally:
            if not finished:  # the caller stopped early: free its blocks now
                self._abandon([request_id])
                self.engine.step()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, rendered with the model's template (or
        chat_template), as vLLM's LLM.chat: continue_final_message continues the last assistant message,
        chat_template_kwargs are extra template variables, tools go to the template as HF passes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = ChatOptions(continue_final_message, chat_template, chat_template_kwargs or {})
        prompts: list[Prompt] = []
        for conversation in conversations:  # image parts: a placeholder for the template, the image beside it
            plain, images = split_images(conversation)
            ids = self.tokenizer.encode_chat(plain, add_generation_prompt, tools, options)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, params, use_tqdm, lora_request, priority)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """A conversation's token ids, opening the assistant's turn."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)


def _per_prompt(value: Any, count: int, field: str, what: str) -> list[Any]:
    """An argument given once for all `count` prompts, or one per prompt (a sequence of exactly that many)."""
    each = list(value) if isinstance(value, Sequence) else [value] * count
    if len(each) != count:
        raise ValueError(f"{field}: got {len(each)} {what} for {count} prompts")
    return each


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):  # a text, or vLLM's TextPrompt / TokensPrompt
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("prompts: got an empty batch")
    return list(prompts)

