"""Benchmark workloads as token ids, so every engine runs exactly the same requests."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ridge.hub import pull_dataset
from ridge.tokenizer import RidgeTokenizer


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


def iter_sharegpt(path: Path) -> Iterator[dict]:
    """Conversations one by one; the file is cut off mid-record, so stop at the first broken one."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt(tokenizer: RidgeTokenizer, num_requests: int, max_prompt_len: int = 1024,
             max_output_len: int = 1024, path: Path | None = None) -> list[Request]:
    """Prompt = a conversation's first human turn (truncated); output length = the reply's length.

    Conversations whose prompt or reply is under 4 tokens are skipped, as vLLM's benchmark does.
    """
    path = path or pull_dataset("sharegpt")
    requests: list[Request] = []
    for record in iter_sharegpt(path):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = tokenizer.encode(turns[0]["value"])[:max_prompt_len]
        reply_len = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if len(prompt) < 4 or reply_len < 4:
            continue
        requests.append(Request(prompt, min(reply_len, max_output_len)))
        if len(requests) == num_requests:
            break
    return requests


def random_requests(vocab_size: int, num_requests: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(100, vocab_size - 100) for _ in range(input_len)], output_len)
            for _ in range(num_requests)]
