"""The dataset readers: ShareGPT's records read a chunk at a time are the records of the whole file."""

import json

import pytest

from ridge.datasets import iter_sharegpt

RECORDS = [{"id": "a", "conversations": [{"from": "human", "value": "Hi ü"}, {"from": "gpt", "value": "[1, 2]"}]},
           {"id": "b", "turns": 12345},
           {"id": "c", "conversations": []},
           {"id": "d", "score": 3.25}]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, 1 << 20])
def test_sharegpt_records_are_the_file_s_whatever_the_chunk(tmp_path, chunk):
    whole = tmp_path / "whole.json"
    whole.write_text("[\n " + ",\n ".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n]\n",
                     encoding="utf-8")
    assert list(iter_sharegpt(whole, chunk)) == RECORDS
    # the pulled file is cut off inside a record: the records before it, and no error
    text = whole.read_text(encoding="utf-8")
    cut = tmp_path / "cut.json"
    cut.write_text(text[:text.index('"score"')], encoding="utf-8")
    assert list(iter_sharegpt(cut, chunk)) == RECORDS[:3]
    cut.write_text('{"not": "an array"}', encoding="utf-8")
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        list(iter_sharegpt(cut, chunk))
