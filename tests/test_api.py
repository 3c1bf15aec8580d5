"""The LLM API on SmolLM2: outputs, finish reasons, stops, logprobs, n, seeds, streaming, abort, timings."""

import pytest

from conftest import CHAT_PROMPTS
from ridge import SamplingParams


@pytest.fixture(scope="module")
def chat(smollm2):
    return smollm2.render_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])


def test_output_shape_and_timings(smollm2, chat):
    out = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=64))[0]
    c = out.outputs[0]
    assert out.finished and out.prompt_token_ids == chat
    assert c.finish_reason == "stop" and c.stop_reason in smollm2.tokenizer.stop_token_ids
    assert "Paris" in c.text
    m = out.metrics
    assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"] and m["decode_s"] >= 0


def test_length_and_ignore_eos(smollm2, chat):
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 80


def test_stop_string_and_stop_token(smollm2, chat):
    full = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    word = full.text.split()[2]
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=30, stop=[word]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == word
    assert c.text == full.text[: full.text.index(word)]
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=30, stop=[word],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert c.text.endswith(word)
    token = full.token_ids[3]
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[token]))[0].outputs[0]
    assert c.stop_reason == token and c.token_ids == full.token_ids[: full.token_ids.index(token) + 1]


def test_min_tokens_defers_eos(smollm2, chat):
    natural = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    n = len(natural.token_ids) + 5
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=n + 20, min_tokens=n))[0].outputs[0]
    assert len(c.token_ids) >= n


def test_logprobs(smollm2, chat):
    c = smollm2.generate(chat, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(c.logprobs) == 6
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert max(entry.values()) == entry[token] <= 0
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)))


def test_n_samples_and_seed(smollm2, chat):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = smollm2.generate(chat, params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    others = [smollm2.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[1:6]]
    b = smollm2.generate([*others, chat], [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [params])[-1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_stream_equals_generate(smollm2, chat):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"], include_stop_str_in_output=True)
    streamed = "".join(smollm2.stream(chat, params))
    assert streamed == smollm2.generate(chat, params)[0].outputs[0].text


def test_abort_frees_blocks(smollm2, chat):
    engine = smollm2.engine
    rid = engine.add_request(chat, SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == rid]
    assert aborted and aborted[0].samples[0].finish_reason == "abort"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_chat_api(smollm2):
    outs = smollm2.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:2]],
                        SamplingParams(temperature=0, max_tokens=8))
    assert len(outs) == 2 and all(o.outputs[0].text for o in outs)
