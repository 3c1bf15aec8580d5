"""The bodies and replies of the pooling runner's endpoints beside /v1/embeddings: vLLM's /v1/score (text pairs'
scores), /v1/rerank (Jina's and Cohere's rerank: documents ordered by their score against a query) and /classify (a
sequence classifier's label probabilities). engine/scoring.py says how a pair is scored."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import model_validator

from ridge.engine.scoring import probabilities
from ridge.serve.protocol import (
    Body,
    RequestError,
    Text,
    check_unicode,
    input_prompts,
    log_labels,
    refuse_unsupported,
)

# vLLM's and Cohere's fields these endpoints do not implement: refused by name when they ask for anything
UNSUPPORTED = {
    "truncate_prompt_tokens": "not supported here; a pair longer than the context is refused",
    "max_tokens_per_doc": "documents are read whole; a pair longer than the context is refused",
    "rank_fields": "documents are texts (or {\"text\": ...}); no fields are ranked",
    "mm_processor_kwargs": "this server reads text only",
}
# vLLM's switches of the activation (the raw logits where false): only the activated score is returned
ACTIVATION_FIELDS = ("use_activation", "activation", "softmax")


class PoolingBody(Body):
    model: Text | None = None
    priority: int = 0  # vLLM's: lower goes first, on a server started with --schedule-policy priority
    user: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, UNSUPPORTED)
        if isinstance(data, dict):
            log_labels(data, ("user",))
        for name in ACTIVATION_FIELDS:
            if isinstance(data, dict) and data.get(name) is False:
                raise ValueError(f"{name}: false is not supported; the activated score (a cross-encoder's sigmoid, "
                                 "a softmax over labels) is returned")
        return data


class ScoreRequest(PoolingBody):
    """vLLM's /v1/score: text_1 against each of text_2, or text_1[i] against text_2[i]."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]

    @model_validator(mode="after")
    def _unicode(self) -> ScoreRequest:
        check_unicode(self.text_1, "text_1")
        check_unicode(self.text_2, "text_2")
        return self


class RerankRequest(PoolingBody):
    """Jina's and Cohere's rerank, as vLLM serves it: the documents ordered by their score against the query."""

    query: Text
    documents: list[Text | dict[str, Any]]
    top_n: int | None = None  # 0 or none: all of them
    return_documents: bool = True  # Cohere's; vLLM returns them always

    @model_validator(mode="after")
    def _check(self) -> RerankRequest:
        check_unicode(self.query, "query")
        check_unicode(self.documents, "documents")
        if self.top_n is not None and self.top_n < 0:
            raise ValueError(f"top_n: must be 0 (all) or more, got {self.top_n}")
        return self

    def texts(self) -> list[str]:
        """The documents' texts (a document is a text or {"text": ...})."""
        if not self.documents:
            raise RequestError("documents: must hold at least one document", "documents")
        texts = []
        for i, doc in enumerate(self.documents):
            text = doc.get("text") if isinstance(doc, dict) else doc
            if not isinstance(text, str) or not text or isinstance(doc, dict) and set(doc) != {"text"}:
                raise RequestError(f"documents.{i}: must be a non-empty text or {{\"text\": ...}}", f"documents.{i}")
            texts.append(text)
        return texts


class ClassifyRequest(PoolingBody):
    """vLLM's /classify: each input's label probabilities."""

    input: Text | list[Text] | list[int] | list[list[int]]

    @model_validator(mode="after")
    def _unicode(self) -> ClassifyRequest:
        check_unicode(self.input, "input")
        return self

    def prompts(self) -> list[str | list[int]]:
        return input_prompts(self.input)


def score_reply(scores: list[float], model: str, tokens: int) -> dict[str, Any]:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_reply(req: RerankRequest, texts: list[str], scores: list[float], model: str, tokens: int) -> dict[str, Any]:
    """The documents by score, highest first, the top_n of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
            "results": results}


def classify_reply(outputs: list[list[float]], labels: tuple[str, ...], model: str, tokens: int) -> dict[str, Any]:
    data = []
    for i, logits in enumerate(outputs):
        probs = probabilities(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else str(best), "probs": probs,
                     "num_classes": len(probs)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
