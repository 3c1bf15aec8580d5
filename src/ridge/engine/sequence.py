"""One sequence's state: its tokens, how many of them are in the KV cache, its block table.

The KV manager (kv/manager.py) is the only writer of the KV fields; the scheduler of status and tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ridge.engine.speculative import SpeculationStats
from ridge.sampling_params import SamplingParams

if TYPE_CHECKING:  # llguidance is imported by the engine, not by every user of a Sequence
    from ridge.engine.structured import Grammar
    from ridge.multimodal.placement import PlacedImage


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def summary(self) -> dict[str, float | None]:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        return {
            "queue_s": span(self.arrival, self.first_scheduled),
            "ttft_s": span(self.arrival, self.first_token),
            "decode_s": span(self.first_token, self.finished),
            "e2e_s": span(self.arrival, self.finished),
        }


@dataclass(eq=False)
class Sequence:
    """token_ids = prompt + output. Tokens [0, num_computed) have K/V in the cache; the rest await a step.

    A sequence samples its next token in the step that computes its last token.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    grammar: Grammar | None = None  # with structured outputs: where the output stands in its grammar
    bad_word_ids: list[list[int]] = field(default_factory=list)  # params.bad_words tokenized (sampler.py)
    adapter: int | None = None  # its LoRA adapter's index in the engine's AdapterSet (lora/apply.py); None: the base
    priority: int = 0  # under the priority policy, lower goes first (engine/scheduler.py)
    embedding: list[float] | None = None  # a pooling runner's: set when its last prompt token is computed
    # A prompt with images (multimodal/placement.py): the images placed in it, its tokens' M-RoPE positions [3,
    # prompt_len], and the delta every token after its last image turns by (its index plus it)
    images: list[PlacedImage] = field(default_factory=list)
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    # spans of the prompt [start, end) whose tokens attend to each other both ways (Gemma 3's images): a prefill
    # chunk never ends inside one (KVManager.chunk_end), and its queries there see to the span's end
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV group, set by the KV manager
    state_slot: int | None = None  # its slot (state-space layers' state, int2's KV tail), set by the KV manager
    # With KV eviction (kv/eviction.py), set by the KV manager: the tokens given back, the most ever given back
    # (what usage reports: a recompute after preemption evicts the same tokens again), and with h2o the attention
    # each block it holds received, by block id
    num_evicted: int = 0
    max_evicted: int = 0
    block_mass: dict[int, float] = field(default_factory=dict)
    # Prefix caching: the chained keys of the full blocks hashed so far (they depend on the tokens only, so
    # they survive preemption), how many of the table's blocks were offered to the cache, and the prompt
    # tokens the first admission found cached.
    block_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0
    # State snapshots (kv/state_snapshots.py), set by the KV manager: the snapshot slot its state starts from in its
    # first step, the positions where its prefill stops to leave a snapshot, (position, slot) of the one this step
    # leaves, and the key of the last one its decode left (which the next replaces)
    restore_from: int | None = None
    snapshot_points: list[int] = field(default_factory=list)
    pending_snapshot: tuple[int, int] | None = None
    decode_snapshot: bytes | None = None
    num_reported: int = 0  # output tokens already handed out in a RequestDelta
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # With params.prompt_logprobs, for sample 0: an entry per prompt token scored so far (the first is None:
    # nothing predicts it). Scored as the prefill computes them, so these prompt tokens never come from the
    # prefix cache; a recompute after preemption scores only what is still missing.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # "stop", "length", "abort" (stopped from outside), or "error" (the engine could not go on: a grammar's
    # matcher refused a token its own mask allowed)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # Speculative decoding: tokens a drafter proposed for this step (the target checks them after the
    # last token, in the same pass), the drafter's distribution over each, and the running counts.
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    num_preemptions: int = 0
    times_passed: int = 0  # steps in which a later arrival was admitted while this one waited (lpm)
    timings: Timings = field(default_factory=Timings)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still has to be computed (1 for a decode, more while prefilling)."""
        return len(self.token_ids) - self.num_computed

    @property
    def prefix_salt(self) -> str | None:
        """What its prefix-cache keys chain from: its cache_salt, and its adapter (whose KV is not the base's)."""
        if self.adapter is None:
            return self.params.cache_salt
        return f"{self.params.cache_salt or ''}\0adapter {self.adapter}"

    def block_images(self, block: int, block_size: int) -> bytes:
        """The digests of the images whose tokens its block `block` holds: part of the block's prefix-cache key, as
        every image's placeholder tokens are alike (a later block differs through its chained parent)."""
        start, end = block * block_size, (block + 1) * block_size
        return b"".join(image.image.digest for image in self.images if image.offset < end and image.end > start)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens still wait to be scored (their logits are computed, not looked up)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.prompt_len)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
