"""The runtime must not change greedy output: batching, chunked prefill, preemption, backend, dtype path."""

import pytest
import torch

from conftest import CHAT_PROMPTS, random_prompts
from ridge import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    chats = [smollm2.render_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chats + random_prompts(20, smollm2.engine.loaded.config.vocab_size, 3, 200, seed=3)  # 32, mixed lengths


@pytest.fixture(scope="module")
def alone(smollm2, prompts):
    """Every fourth request (8: 3 chats, 5 random of 3-200 tokens) run by itself: the plain path."""
    return [smollm2.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts[::4]]


@pytest.fixture(scope="module")
def batched(smollm2, prompts):
    """All 32 in one batch: what the checks below hold the other runtime paths to, once it equals alone."""
    return tokens(smollm2.generate(prompts, GREEDY))


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_32_equals_alone(batched, alone):
    assert batched[::4] == alone


def test_tiny_token_budget_chunks_prefill(make_llm_for_test, smollm2_path, prompts, alone):
    llm = make_llm_for_test(smollm2_path, dtype="float32", max_num_batched_tokens=7)
    assert tokens(llm.generate(prompts[::4], GREEDY)) == alone


def test_tiny_kv_pool_preempts_and_recomputes(make_llm_for_test, smollm2_path, prompts, batched):
    # 16 blocks of 16 = 256 tokens: far less than 16 requests need at once
    llm = make_llm_for_test(smollm2_path, dtype="float32", kv_cache_memory=16 * 16 * 30 * 2 * 3 * 64 * 4)
    assert llm.engine.pool.num_blocks == 16
    outs = llm.generate(prompts[:16], GREEDY)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was meant to force preemption"
    assert tokens(outs) == batched[:16]


def test_reference_backend_agrees(make_llm_for_test, smollm2_path, prompts, batched):
    llm = make_llm_for_test(smollm2_path, dtype="float32", attention_backend="reference", max_num_batched_tokens=64)
    assert tokens(llm.generate(prompts[:8], GREEDY)) == batched[:8]


def test_cpu_kernels_agree_with_torch_ops(make_llm_for_test, smollm2_path, prompts, batched):
    """The C++ decode attention and fused norm / activation against the pure-torch paths, in float32."""
    plain = make_llm_for_test(smollm2_path, dtype="float32", cpu_kernels=False)
    assert plain.engine.runner.backend.ops is None
    assert tokens(plain.generate(prompts[:12], GREEDY)) == batched[:12]


def test_bf16_packed_linears_are_as_accurate_as_torch_bf16(smollm2, make_llm_for_test, smollm2_path, prompts):
    """bf16 results differ with the kernel's summation order, so compare errors against float32 logits:
    the oneDNN-packed linears must be no less accurate than torch's own bf16 matmuls."""
    from ridge.linear.dense import onednn_packs

    if not onednn_packs(torch.bfloat16, "cpu"):
        pytest.skip("oneDNN packs no bf16 weights on this CPU (needs AVX512BW/VL/DQ or AVX-NE-CONVERT)")
    packed = make_llm_for_test(smollm2_path, dtype="bfloat16")
    plain = make_llm_for_test(smollm2_path, dtype="bfloat16", packed_linear=False, cpu_kernels=False)
    assert packed.engine.loaded.model.output_projection is not None
    assert plain.engine.loaded.model.output_projection is None
    for ids in prompts[:4]:
        exact = smollm2.engine.prompt_logits(ids)
        err_packed = (packed.engine.prompt_logits(ids) - exact).abs().mean().item()
        err_plain = (plain.engine.prompt_logits(ids) - exact).abs().mean().item()
        assert err_packed < 1.5 * err_plain, (err_packed, err_plain)


def test_priority_scheduling_serves_urgent_arrivals_first_and_keeps_every_token(make_llm_for_test, smollm2_path,
                                                                                prompts, alone):
    """Under the priority policy, with room for 3 sequences: urgent requests arriving while 5 less important ones run
    displace some of those (recomputed later) and finish first; every request's greedy tokens are its own alone."""
    llm = make_llm_for_test(smollm2_path, dtype="float32", schedule_policy="priority", max_num_seqs=3)
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    preempted = 0

    def step() -> None:
        nonlocal preempted
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.samples[0].token_ids)
            if delta.finished:
                finished.append(delta.request_id)
                preempted += delta.metrics["num_preemptions"]

    chosen = prompts[::4]
    low = [engine.add_request(p, GREEDY, priority=1) for p in chosen[:5]]
    for _ in range(3):
        step()
    urgent = [engine.add_request(p, GREEDY, priority=-1) for p in chosen[5:]]
    while engine.has_unfinished:
        step()
    assert set(finished[:3]) == set(urgent), "an urgent request finished after a less important one"
    assert preempted >= 3, "the urgent arrivals were meant to displace running requests"
    assert [tokens[r] for r in low + urgent] == alone
