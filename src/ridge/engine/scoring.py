"""Scores of text pairs (LLM.score, /v1/score, /v1/rerank) and label probabilities (LLM.classify, /classify), from a
pooling engine's outputs.

A cross-encoder (a sequence classifier of one label: bge-reranker, ms-marco-MiniLM) reads each pair as one input,
joined by its tokenizer's pair template ([CLS] query [SEP] document [SEP]); the pair's score is the sigmoid of its
logit. An embedding model embeds each text once, and a pair's score is the cosine similarity of its two embeddings
(they come L2-normalized: their dot product). Both are vLLM's rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ridge.tokenizer import RidgeTokenizer


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs a score request asks for (vLLM's rule): one text_1 against each text_2, or text_1[i] against
    text_2[i]; ValueError naming the field otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError(f"{name}: must be a non-empty text or a list of them")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"text_2: {len(second)} texts against {len(first)} in text_1; give one text_1, or as many "
                         "as text_2")
    return list(zip(first, second, strict=True))


def probabilities(logits: list[float]) -> list[float]:
    """A classifier's label probabilities: a softmax over its labels, or the sigmoid of a single label's logit."""
    values = torch.tensor(logits)
    return (values.sigmoid() if len(logits) == 1 else values.softmax(-1)).tolist()


def check_classifier(num_labels: int, what: str, one_label: bool = False) -> None:
    """ValueError naming `what` where the model has no classification head (or, one_label, not a single label)."""
    if not num_labels:
        raise ValueError(f"{what}: this model has no classification head (a sequence classifier's, such as "
                         "BertForSequenceClassification)")
    if one_label and num_labels != 1:
        raise ValueError(f"{what}: a cross-encoder scores with one label; this classifier has {num_labels} (classify "
                         "its inputs instead)")


@dataclass
class ScorePlan:
    """What to pool for a list of pairs, and how each pair's score comes of the pooled outputs."""

    prompts: list[list[int]]  # the inputs to pool
    # for an embedding model: each pair's two prompts (indices into prompts); None for a cross-encoder, whose
    # prompts are the pairs, one each
    pairs: list[tuple[int, int]] | None

    @classmethod
    def of(cls, text_1: str | Sequence[str], text_2: str | Sequence[str], tokenizer: RidgeTokenizer,
           num_labels: int) -> ScorePlan:
        """The plan of a score request's pairs (score_pairs') on a model of `num_labels` (0: an embedding model)."""
        pairs = score_pairs(text_1, text_2)
        if num_labels:
            check_classifier(num_labels, "score", one_label=True)
            return cls([tokenizer.encode_pair(a, b) for a, b in pairs], None)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each text embedded once
        index = {text: i for i, text in enumerate(texts)}
        return cls([tokenizer.encode(t) for t in texts], [(index[a], index[b]) for a, b in pairs])

    def pair_ids(self, i: int) -> list[int]:
        """Pair i's token ids as the model read them: its one input, or its two texts' one after the other."""
        if self.pairs is None:
            return self.prompts[i]
        a, b = self.pairs[i]
        return self.prompts[a] + self.prompts[b]

    def scores(self, pooled: list[list[float]]) -> list[float]:
        """Each pair's score from the pooled outputs of `prompts`, in order."""
        if self.pairs is None:
            return [probabilities(logits)[0] for logits in pooled]
        vectors = [torch.tensor(v) for v in pooled]
        return [float(vectors[a] @ vectors[b]) for a, b in self.pairs]
