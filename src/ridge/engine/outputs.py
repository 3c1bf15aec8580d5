"""What the engine hands out: per-step deltas from the core, and the outputs users read.

The engine (engine.py) reports, each step, only what the step added to each sample (RequestDelta):
new token ids, their logprobs, a finish. The output processor (output_processor.py) turns deltas into
RequestOutputs with text, for `LLM` in-process and for the server in its own process alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class OutputKind(Enum):
    """What the output processor hands out for a request: its whole output once, when it finishes
    (`LLM.generate`, non-streamed replies), or each step's new text and tokens (streams)."""

    FINAL = "final"
    DELTA = "delta"


@dataclass
class CompletionOutput:
    """One sample. In a DELTA output, text, token_ids and logprobs are what is new since the last one."""

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
    # with SamplingParams.prompt_logprobs: an entry per prompt token (None for the first); a stream carries
    # it in its first output only
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a pooling runner's: the prompt's, L2-normalized (a classifier's: its labels' logits); outputs stay empty
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # L2-normalized


@dataclass
class EmbeddingRequestOutput:
    """A prompt's embedding (LLM.embed), as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's relevance (the sigmoid of its logit), or two embeddings' cosine similarity


@dataclass
class ScoringRequestOutput:
    """A pair of texts' score (LLM.score), as vLLM's: prompt_token_ids the pair's as the model read it (a
    cross-encoder's one input, or the two texts' ids one after the other)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label: a softmax over the labels (the sigmoid of a single label's logit)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """A prompt's label probabilities (LLM.classify), as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class SampleDelta:
    """What one step added to a sample."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class RequestDelta:
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: dict[str, float | None]
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, when the prompt has been scored
    embedding: list[float] | None = None  # a pooling runner's, in the request's last delta


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


@dataclass
class AdapterUse:
    """The LoRA adapters the scheduler's sequences use, by name (vLLM's lora_requests_info)."""

    running: list[str]
    waiting: list[str]
    max_loras: int


class StepError(RuntimeError):
    """A step raised; the requests it was running (`request_ids`) have ended, the engine can go on."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids, self.message = request_ids, message
