"""The text datasets ridge pulls (hub.pull_dataset), read record by record: shared by the benchmarks'
workloads, the quantizers' calibration and the perplexity evaluation, none of which owns them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


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
