"""The offline Python API, shaped like vLLM's: LLM(model).generate(prompts, params) and LLM.chat()."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from ridge.config import EngineConfig
from ridge.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ridge.engine.engine import LLMEngine, RequestOutput
from ridge.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """LLM(model, **engine_args): model is an alias (`ridge pull` names), a .gguf file or an HF directory.

    Engine args are EngineConfig's fields: dtype, device, block_size, kv_cache_memory,
    max_num_batched_tokens, max_num_seqs, max_model_len, attention_backend, num_threads.
    """

    def __init__(self, model: str, progress: bool = True, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs come back in prompt order.

        Every prompt is validated before any is queued, so a bad one leaves the engine untouched.
        A list of ints is one tokenized prompt; a list of lists or strings is a batch.
        """
        batch = _as_batch(prompts)
        param_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(param_list) != len(batch):
            raise ValueError(f"params: got {len(param_list)} SamplingParams for {len(batch)} prompts")
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        for prompt, ids, p in zip(batch, encoded, param_list, strict=True):
            if isinstance(prompt, str) and not prompt:
                raise ValueError("prompt: must not be empty (0 characters)")
            self.engine.validate(ids, p)
        order = [self.engine.add_request(ids, p) for ids, p in zip(encoded, param_list, strict=True)]
        done: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished:
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:  # a failed step, Ctrl-C: the batch's other requests give their blocks back
            for request_id in order:
                self.engine.abort(request_id)
            raise
        for request_id, prompt in zip(order, batch, strict=True):
            done[request_id].prompt = prompt if isinstance(prompt, str) else None
        return [done[i] for i in order]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | None = None
                    ) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first (see engine/beam_search.py)."""
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return beam_search(self.engine, encoded, params or BeamSearchParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt as they are decoded (one sample: params.n must be 1)."""
        if params is not None and params.n != 1:
            raise ValueError(f"n must be 1 when streaming, got {params.n}")
        request_id = self.engine.add_request(prompt, params)
        seq = self.engine.sequences(request_id)[0]
        try:
            while not seq.finished:
                self.engine.step()
                if delta := seq.stream_delta():
                    yield delta
            if delta := seq.stream_delta():
                yield delta
        finally:
            if not seq.finished:  # the caller stopped early: free its blocks now
                self.engine.abort(request_id)
                self.engine.step()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, rendered with the model's template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("prompts: got an empty batch")
    return list(prompts)
