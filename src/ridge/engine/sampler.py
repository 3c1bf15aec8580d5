"""Logits -> tokens for a whole batch at once: penalties, temperature, top-k, top-p, min-p, seeds.

Sampling draws token = argmax(p / E) with E ~ Exponential(1) per vocabulary entry, which samples
exactly from p (the Gumbel-max trick in exponential form) and makes every row independent: a
seeded row draws its noise from its own generator, so its tokens do not depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ridge.engine.sequence import Sequence

if TYPE_CHECKING:
    from ridge.engine.structured import GrammarCompiler


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # sampled token + top-n, for rows that asked


class Sampler:
    def __init__(self, vocab_size: int, stop_token_ids: frozenset[int],
                 grammars: GrammarCompiler | None = None) -> None:
        """grammars: the masks of sequences with structured outputs (engine/structured.py)."""
        self.vocab_size = vocab_size
        self.eos_ids = sorted(i for i in stop_token_ids if i < vocab_size)
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [B, V] float32, row i for seqs[i]."""
        raw = logits
        params = [s.params for s in seqs]
        logits = self._penalize(logits, seqs)
        logits = self.bias(logits, seqs)
        logits = self._ban_bad_words(logits, seqs)
        logits = self._block_early_stop(logits, seqs)
        logits = self._constrain(logits, seqs, copy=logits is raw and any(p.logprobs is not None for p in params))

        tokens = logits.max(dim=-1).indices  # argmax, first index on ties; max(dim) runs 2.5x faster on CPU
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:  # (on a GPU, an all-greedy step reads the device once: its tokens)
            rows = torch.tensor(sampled_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [seqs[i] for i in sampled_rows])
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, tokens, seqs))

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        if all(p.repetition_penalty == 1 and not p.presence_penalty and not p.frequency_penalty for p in params):
            return logits
        device, vocab = logits.device, logits.shape[1]
        counts = torch.zeros_like(logits)  # occurrences in the output
        seen = torch.zeros_like(logits, dtype=torch.bool)  # in prompt or output
        for i, s in enumerate(seqs):  # building the index lists is Python; the arithmetic below is batched
            ids = torch.tensor(s.token_ids, device=device, dtype=torch.long).clamp_(max=vocab - 1)
            seen[i, ids] = True
            out = ids[s.prompt_len :]
            counts[i].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - freq * counts - pres * (counts > 0)

    def bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """What a request fixes about every step's logits: OpenAI's logit_bias (added to chosen tokens) and
        vLLM's allowed_token_ids (every other token at -inf)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logit_bias or s.params.allowed_token_ids]
        if not rows:
            return logits
        bias = torch.zeros_like(logits)
        for i in rows:
            params = seqs[i].params
            if params.allowed_token_ids:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
                bias[i].fill_(float("-inf")).index_fill_(0, allowed, 0.0)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                values = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                bias[i, ids] += values
        return logits + bias

    def _ban_bad_words(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A bad word's last token is banned wherever the output ends with the rest of it."""
        banned = [(i, [word[-1] for word in s.bad_word_ids
                       if len(word) == 1 or (s.num_outputs >= len(word) - 1
                                             and s.token_ids[len(s.token_ids) - len(word) + 1:] == word[:-1])])
                  for i, s in enumerate(seqs) if s.bad_word_ids]
        if not any(ids for _, ids in banned):
            return logits
        logits = logits.clone()
        for i, ids in banned:
            logits[i, ids] = float("-inf")
        return logits

    @torch.inference_mode()  # the runner's logits are inference tensors: written in place only in this mode
    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence], copy: bool) -> torch.Tensor:
        """Rows with a grammar keep only the tokens it allows next (in place, or on a copy when the raw logits
        are still needed for logprobs)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return logits
        allowed = self.grammars.masks([seqs[i].grammar for i in rows]).to(logits.device)
        logits = logits.clone() if copy else logits
        if len(rows) == len(seqs):  # every row constrained: one pass over the logits, no gather
            return logits.masked_fill_(allowed[:, :logits.shape[1]].logical_not_(), float("-inf"))
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(allowed[:, :logits.shape[1]].logical_not_(), float("-inf"))
        return logits

    def _block_early_stop(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rows below min_tokens cannot pick EOS or their stop tokens yet."""
        rows = [i for i, s in enumerate(seqs) if s.num_outputs < s.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            banned = set(seqs[i].params.stop_token_ids or [])
            if not seqs[i].params.ignore_eos:
                banned.update(self.eos_ids)
            ids = [t for t in banned if t < logits.shape[1]]
            logits[i, ids] = float("-inf")
        return logits

    def probabilities(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[B, V]: the distribution each (non-greedy) row samples from, after logit bias, temperature,
        top-k, top-p and min-p. Speculative decoding compares the target's and the drafter's."""
        return self._distribution(self.bias(logits, seqs), seqs)

    def _distribution(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        params = [s.params for s in seqs]
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        # From each row's maximum, so that a tiny temperature sends the others to -inf, never the top to
        # +inf (inf - inf is NaN); clamped to float32's smallest normal, which a 1e-39 would fall under.
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature.clamp(min=torch.finfo(torch.float32).tiny)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if bool((top_k > 0).any() or (top_p < 1).any()):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = self._distribution(logits, seqs)
        noise = torch.empty_like(probs).exponential_()
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=s.generator)
        return (probs / noise).max(dim=-1).indices

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(seqs)
        if not rows:
            return result
        logp = raw[rows].log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        k = max(seqs[i].params.logprobs for i in rows)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            entry = dict(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
            entry[int(tokens[i])] = chosen[j]
            result[i] = entry
        return result


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (0 / 1.0 switch a row's filter off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, logits.shape[1]).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # keep a token if the mass before it is below top_p; the first token is always kept
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def bad_word_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token ids as it would be generated: at the start of a text and after a space (a
    different token in BPE vocabularies), as vLLM bans them."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = encode(text)
            if ids and ids not in found:
                found.append(ids)
    return found
