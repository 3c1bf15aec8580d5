"""The output processor alone: engine deltas in, outputs out, for streams and whole replies alike."""

import pytest

from ridge.engine.output_processor import OutputProcessor
from ridge.engine.outputs import OutputKind, RequestDelta, SampleDelta
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import RidgeTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return RidgeTokenizer.from_path(smollm2_path)


def deltas(tokens: list[int], per_step: int, finish: tuple[str, int | str | None] | None = ("length", None)):
    """The engine's deltas of one sample producing `tokens`, per_step at a time; the last one finishes."""
    steps = [tokens[i:i + per_step] for i in range(0, len(tokens), per_step)]
    for i, chunk in enumerate(steps):
        last = i == len(steps) - 1 and finish is not None
        yield RequestDelta("r", [SampleDelta(0, chunk, None, finish[0] if last else None,
                                             finish[1] if last else None)], last, {}, 0)


def test_final_hands_out_the_whole_output_once(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("The capital of France is Paris. It is large.", add_special_tokens=False)
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=len(ids)), OutputKind.FINAL)
    outputs = [out for d in deltas(ids, 3) for out in processor.process([d])[0]]
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == tokenizer.decode(ids) and outputs[0].outputs[0].token_ids == ids
    assert not processor.trackers


def test_a_stream_holds_back_what_may_become_a_stop_string_and_stops_exactly(tokenizer):
    text = "The capital of France is Paris. It is large."
    ids = tokenizer.encode(text, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=100, stop=["Paris."])
    processor.add("r", None, [1, 2], params, OutputKind.DELTA)
    pieces, stopped = [], []
    for d in deltas(ids, 1, finish=None):
        outputs, stops = processor.process([d])
        stopped += stops
        for out in outputs:
            for c in out.outputs:
                pieces.append(c.text)
                assert "Paris"[:3] not in c.text or c.finish_reason == "stop"  # held until it is known
    assert stopped == [("r", 0)]  # the caller aborts the sample in the engine
    assert "".join(pieces) == "The capital of France is "
    assert not processor.trackers  # finished here; the engine's later deltas are ignored
    assert processor.process(list(deltas(ids, 2)))[0] == []


def test_a_stop_token_ends_the_sample_without_entering_its_text(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    eos = min(tokenizer.stop_token_ids)
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1], SamplingParams(), OutputKind.FINAL)
    (out,), _ = processor.process([RequestDelta("r", [SampleDelta(0, [*ids, eos], None, "stop", eos)], True, {}, 0)])
    choice = out.outputs[0]
    assert choice.text == "Hello there" and choice.token_ids == [*ids, eos] and choice.stop_reason == eos
