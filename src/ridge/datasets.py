"""The text datasets ridge pulls (hub.pull_dataset), read record by record: shared by the benchmarks'
workloads, the quantizers' calibration and the perplexity evaluation, none of which owns them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_sharegpt(path: Path, chunk: int = 1 << 20) -> Iterator[dict]:
    """Conversations one by one, the file read a chunk at a time (most readers want only its first records); the
    file is cut off mid-record, so stop at the first broken one."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        text = f.read(chunk)
        while "[" not in text:
            more = f.read(chunk)
            if not more:
                raise ValueError(f"{path}: not a ShareGPT file (no JSON array of conversations)")
            text += more
        pos = text.index("[") + 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos < len(text) and text[pos] == "]":
                return
            try:  # a record is an object: decoded, it is whole
                record, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:  # cut by the chunk's end, or by the file's
                more = f.read(chunk)
                if not more:
                    return
                text, pos = text[pos:] + more, 0
                continue
            yield record
