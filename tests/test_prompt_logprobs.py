"""Prompt logprobs: scored during the prefill, equal to the logits of one whole-prompt pass, however the
prompt is chunked, cached, batched or preempted."""

from __future__ import annotations

import torch

from conftest import CHAT_PROMPTS
from ridge import SamplingParams


def reference(llm, ids: list[int], top: int) -> list[dict[int, float] | None]:
    logp = llm.engine.prompt_logits(ids).log_softmax(dim=-1)
    entries: list[dict[int, float] | None] = [None]
    for i in range(1, len(ids)):
        values, tokens = logp[i - 1].topk(top)
        entry = dict(zip(tokens.tolist(), values.tolist(), strict=True))
        entry[ids[i]] = logp[i - 1, ids[i]].item()
        entries.append(entry)
    return entries


def assert_close(got, expected, atol=2e-4):
    assert len(got) == len(expected) and got[0] is None
    for g, e in zip(got[1:], expected[1:], strict=True):
        assert g.keys() == e.keys(), (g, e)
        assert all(abs(g[k] - e[k]) < atol for k in g), (g, e)


def test_prompt_logprobs_equal_a_whole_prompt_pass_under_chunks_cache_and_preemption(make_llm_for_test,
                                                                                     smollm2_path):
    """16-token chunks, a prefix cache that already holds the prompt, two samples and a pool so small that
    the batch preempts: every prompt is scored once, in full, as one pass scores it."""
    llm = make_llm_for_test(smollm2_path, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True,
                            kv_cache_memory="2MiB")
    prompts = [p * 2 for p in CHAT_PROMPTS[:4]]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    expected = [reference(llm, i, 2) for i in ids]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # these prompts now cached
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2, n=2)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, exp in zip(outputs, expected, strict=True):
        assert out.num_cached_tokens == 0  # a scored prompt is computed, not looked up
        assert_close(out.prompt_logprobs, exp)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_a_one_token_prompt_and_the_prompt_s_own_token(make_llm_for_test, smollm2_path):
    llm = make_llm_for_test(smollm2_path, dtype="float32")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]
    ids = llm.tokenizer.encode("Rare words: zymurgy quixotic")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    expected = reference(llm, ids, 0)
    assert_close(out.prompt_logprobs, expected)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # top 0: the prompt's own token alone
    assert torch.isfinite(torch.tensor([next(iter(e.values())) for e in out.prompt_logprobs[1:]])).all()
