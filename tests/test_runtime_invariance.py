"""The runtime must not change greedy output: batching, chunked prefill, preemption, backend, dtype path."""

import pytest

from conftest import CHAT_PROMPTS, random_prompts
from ridge import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    chats = [smollm2.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chats + random_prompts(20, smollm2.engine.loaded.config.vocab_size, 3, 200, seed=3)  # 32, mixed lengths


@pytest.fixture(scope="module")
def alone(smollm2, prompts):
    """Each request run by itself: the plain path."""
    return [smollm2.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_32_equals_alone(smollm2, prompts, alone):
    assert tokens(smollm2.generate(prompts, GREEDY)) == alone


def test_tiny_token_budget_chunks_prefill(make_llm, smollm2_path, prompts, alone):
    llm = make_llm(smollm2_path, dtype="float32", max_num_batched_tokens=7)
    assert tokens(llm.generate(prompts, GREEDY)) == alone


def test_tiny_kv_pool_preempts_and_recomputes(make_llm, smollm2_path, prompts, alone):
    # 24 blocks of 16 = 384 tokens: far less than 32 requests need at once
    llm = make_llm(smollm2_path, dtype="float32", kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4)
    assert llm.engine.pool.num_blocks == 24
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was meant to force preemption"
    assert tokens(outs) == alone


def test_reference_backend_agrees(make_llm, smollm2_path, prompts, alone):
    llm = make_llm(smollm2_path, dtype="float32", attention_backend="reference", max_num_batched_tokens=64)
    assert tokens(llm.generate(prompts[:8], GREEDY)) == alone[:8]


def test_bf16_packed_kernels_agree_with_plain_bf16(make_llm, smollm2_path):
    """The oneDNN-packed bf16 linears against torch's plain bf16 linears: same greedy tokens."""
    packed = make_llm(smollm2_path, dtype="bfloat16")
    plain = make_llm(smollm2_path, dtype="bfloat16", packed_linear=False)
    chats = [packed.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_tokens=16)
    a, b = tokens(packed.generate(chats, params)), tokens(plain.generate(chats, params))
    # bf16 rounding differs between kernels, so allow a late divergence but not a different answer
    agree = sum(x[:8] == y[:8] for x, y in zip(a, b, strict=True))
    assert agree >= 5, (a, b)
