"""Prompt logprobs: how likely the model found each prompt token, scored as the prefill computes it.

A prefill chunk's row at position p predicts token p + 1, so a sequence asking for prompt logprobs has
its prompt rows projected onto the vocabulary too (the plain path projects only the rows that sample).
The projection runs in slices of rows: a 2,048-token chunk of a 152k vocabulary would otherwise hold
1.2 GB of float32 logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ridge.engine.sequence import Sequence

SLICE_ROWS = 256


@dataclass
class PromptRows:
    """Rows of a step that score prompt tokens: `count` of them, the first predicting seq.token_ids[first_token]."""

    seq: Sequence
    first_token: int
    count: int


def rows_to_score(seq: Sequence, start: int, end: int) -> PromptRows | None:
    """The rows of seq's chunk [start, end) that score prompt tokens not scored yet (None if none)."""
    if not seq.scores_prompt:
        return None
    first = max(start + 1, len(seq.prompt_logprobs))  # the list opens with token 0's None: nothing predicts it
    last = min(end, seq.prompt_len - 1)  # the row of the prompt's last token samples the output
    return PromptRows(seq, first, last - first + 1) if last >= first else None


def slices(count: int) -> list[tuple[int, int]]:
    """(first row, rows) of each projection record() makes of a sequence's `count` scored rows, in its order."""
    return [(begin, min(SLICE_ROWS, count - begin)) for begin in range(0, count, SLICE_ROWS)]


def record(rows: list[PromptRows], hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append the entries scored by `hidden` (the rows' final hidden states, in order) to each sequence's
    prompt_logprobs: the prompt token's logprob and its params.prompt_logprobs most likely alternatives."""
    offset = 0
    for r in rows:
        seq = r.seq
        top = seq.params.prompt_logprobs
        for begin, n in slices(r.count):
            logp = project(hidden[offset + begin: offset + begin + n]).log_softmax(dim=-1)
            first = r.first_token + begin
            targets = torch.tensor(seq.token_ids[first:first + n], device=logp.device)
            chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_vals, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
            for token, value, ids, vals in zip(targets.tolist(), chosen, top_ids.tolist(), top_vals.tolist(),
                                               strict=True):
                entry = dict(zip(ids, vals, strict=True))
                entry[token] = value
                seq.prompt_logprobs.append(entry)
        offset += r.count
