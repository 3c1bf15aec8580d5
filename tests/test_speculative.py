"""Speculative decoding: exact acceptance (statistically), greedy identity with both drafters, the policy."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from conftest import CHAT_PROMPTS, module_engine
from ridge import SamplingParams
from ridge.engine.speculative import LinearCost, SpeculationPolicy, expected_tokens, verify

# ---- the acceptance rule, on a small Markov chain where the exact distribution is known -------------

VOCAB = 5
Z_999 = 3.0902  # the standard normal's 0.999 quantile


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy here)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, VOCAB, generator=g) * sharpness).softmax(dim=-1)


TARGET = _markov(1, 1.5)  # p(next | last token)
DRAFTER = _markov(2, 1.5)  # q: a different chain, so that rejections are common


def _always_accept(target, draft, draft_probs, greedy, generator):  # the deliberately wrong rule
    return list(draft) + [int(torch.multinomial(target[len(draft)], 1, generator=generator))]


def _first_two_tokens(rule, deterministic_draft: bool, draws: int, k: int = 2) -> torch.Tensor:
    """Histogram [V, V] of the first two tokens generated after token 0 by speculative steps with `rule`."""
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        out: list[int] = []
        last = 0
        while len(out) < 2:
            draft, rows, context = [], [], last
            for _ in range(k):
                q = DRAFTER[context]
                token = int(q.argmax()) if deterministic_draft else int(torch.multinomial(q, 1, generator=g))
                draft.append(token)
                rows.append(q)
                context = token
            target = TARGET[[last, *draft]]  # row i: the target's distribution after draft i - 1
            emitted = rule(target, draft, None if deterministic_draft else torch.stack(rows), False, g)
            out += emitted
            last = emitted[-1]
        counts[out[0], out[1]] += 1
    return counts


def _chi2(counts: torch.Tensor) -> float:
    expected = TARGET[0].unsqueeze(1) * TARGET * counts.sum()  # p(x1 | 0) p(x2 | x1)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["sampled-draft", "one-hot-draft"])
def test_accepted_tokens_follow_the_target_distribution(deterministic_draft):
    """Chi-square over the 25 cells of (x1, x2) against the target's exact joint distribution, at the
    0.999 quantile: a correct rule fails this with probability 0.1% for a random seed (the seed is fixed,
    so the test is deterministic). Always-accept emits the drafter's tokens and must fail it."""
    draws = 6000
    critical = chi2_critical(VOCAB * VOCAB - 1)
    assert _chi2(_first_two_tokens(verify, deterministic_draft, draws)) < critical
    assert _chi2(_first_two_tokens(_always_accept, deterministic_draft, draws)) > critical


def test_greedy_verification_keeps_drafts_while_they_equal_the_argmax():
    logits = torch.tensor([[0.0, 5, 0], [9, 0, 0], [0, 0, 3], [0, 7, 0]])
    assert verify(logits, [1, 0, 1], None, greedy=True) == [1, 0, 2]  # third draft rejected, argmax instead
    assert verify(logits, [1, 0, 2], None, greedy=True) == [1, 0, 2, 1]  # all accepted, plus the bonus
    assert verify(logits[:1], [], None, greedy=True) == [1]


# ---- the break-even model and the adaptive policy ----------------------------------------------------

@pytest.mark.parametrize(("a", "tokens"), [(0.6, 2.31), (0.8, 3.36), (0.9, 4.10)])
def test_expected_tokens_per_pass(a, tokens):
    assert expected_tokens(a, 4) == pytest.approx(tokens, abs=0.005)  # (1 - a^5) / (1 - a)


def _policy(fixed_s: float, per_token_s: float, acceptance: float) -> SpeculationPolicy:
    policy = SpeculationPolicy(num_speculative_tokens=4)
    for tokens in (1, 4, 16, 64, 256):
        policy.target_cost.add(tokens, fixed_s + per_token_s * tokens)
    for batch in (1, 4, 16, 64):
        policy.draft_cost.add(batch, 0.1 * (fixed_s + per_token_s * batch))  # a drafter ~10% of the target
    policy.observe_verification(100, round(100 * acceptance))
    policy.accepted, policy.rejected = acceptance * 100, (1 - acceptance) * 100
    return policy


def test_adaptive_policy_speculates_when_memory_bound_and_not_when_compute_bound():
    policy = _policy(fixed_s=0.050, per_token_s=0.0001, acceptance=0.8)  # weights dominate: verifying is free
    assert policy.choose(1) >= 3
    assert policy.predicted_speedup(4, 1) == pytest.approx(expected_tokens(0.8, 4) * 0.0501 / (0.0505 + 4 * 0.00501),
                                                           rel=1e-3)
    busy = _policy(fixed_s=0.001, per_token_s=0.001, acceptance=0.8)  # every token costs: large batch
    assert busy.choose(64) == 0
    assert LinearCost()(10) is None  # no measurements, no guess


def test_adaptive_policy_cold_start_and_exploration():
    """Before any fit, speculation is tried only where a verification stays a small step (a draft model's
    first drafts for a large batch cost it the whole batch's prompts); once the model says no with a wide
    margin, exploration re-measures plain steps only."""
    fresh = SpeculationPolicy(num_speculative_tokens=4)
    assert fresh.choose(1) == 0  # measure a plain step first
    fresh.target_cost.add(1, 0.05)
    assert fresh.choose(1) == 4
    fresh.target_cost.add(64, 0.3)  # a second size: the fit exists, nothing measured about drafting yet
    big = SpeculationPolicy(num_speculative_tokens=4)
    big.target_cost.add(64, 0.3)
    assert [big.choose(64) for _ in range(3 * big.explore_every)] == [0] * (3 * big.explore_every)
    busy = _policy(fixed_s=0.001, per_token_s=0.001, acceptance=0.8)
    assert [busy.choose(64) for _ in range(3 * busy.explore_every)] == [0] * (3 * busy.explore_every)
    close = _policy(fixed_s=0.050, per_token_s=0.01, acceptance=0.8)  # just short of break-even at batch 16
    choices = [close.choose(16) for _ in range(2 * close.explore_every)]
    assert 0.9 <= close.last_speedup < 1.0 and choices.count(4) == 2


# ---- the engine: the same greedy tokens with speculation as without -----------------------------------

PROMPTS = CHAT_PROMPTS + [
    "Repeat exactly: red, green, blue, red, green, blue, red, green,",
    "def square(x):\n    return x * x\n\ndef cube(x):\n    return x * x * x\n\ndef square(x):\n",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "a b c d e f g a b c d e f g a b c",
    "Copy this sentence: the quick brown fox jumps over the lazy dog. Copy: the quick",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    return [o.outputs[0].token_ids for o in smollm2.generate(PROMPTS, GREEDY)]


def _weaken(llm, seed: int = 0) -> None:
    """Perturb the draft model so that it disagrees with the target now and then (rejections to verify)."""
    g = torch.Generator().manual_seed(seed)
    norm = llm.engine.drafter.runner.model.norm.weight
    norm.mul_(1 + 0.5 * torch.randn(norm.shape, generator=g))


@pytest.fixture(scope="module")
def drafting(make_llm, smollm2_path):
    """SmolLM2 drafted for by its own weights, weakened, 4 drafts a step: the engine of the checks below that
    need no other settings (engine.check_integrity between them: the session's check after every test)."""
    for llm in module_engine(make_llm, smollm2_path, dtype="float32", draft_model=str(smollm2_path),
                             num_speculative_tokens=4, speculation_policy="fixed"):
        _weaken(llm)
        yield llm


@pytest.mark.parametrize(("drafter", "k", "policy"), [
    ("ngram", 1, "fixed"), ("ngram", 5, "fixed"), ("ngram", 4, "adaptive"),
    ("draft", 4, "fixed"),
])
def test_greedy_speculation_equals_plain_decoding(make_llm_for_test, smollm2_path, plain_outputs, drafter, k, policy,
                                                request):
    if drafter == "draft":
        llm = request.getfixturevalue("drafting")
    else:
        llm = make_llm_for_test(smollm2_path, dtype="float32", speculate="ngram", num_speculative_tokens=k,
                                speculation_policy=policy)
    batch = llm.generate(PROMPTS[::2], GREEDY)  # batch 8: chats, and repetitive text (n-grams find drafts there)
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS[-1:]]  # batch 1
    assert [o.outputs[0].token_ids for o in batch] == plain_outputs[::2]
    assert [o.outputs[0].token_ids for o in alone] == plain_outputs[-1:]
    drafted = sum(o.metrics["spec_draft_tokens"] for o in batch + alone)
    accepted = sum(o.metrics["spec_accepted_tokens"] for o in batch + alone)
    assert 0 < accepted < drafted  # it did speculate, and some drafts were rejected


def test_speculation_under_preemption_and_prefix_caching(make_llm_for_test, smollm2_path, plain_outputs):
    llm = make_llm_for_test(smollm2_path, dtype="float32", draft_model=str(smollm2_path), num_speculative_tokens=3,
                   speculation_policy="fixed", kv_cache_memory=24 * 16 * 30 * 3 * 64 * 2 * 4)  # 24 blocks
    _weaken(llm, seed=1)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == plain_outputs
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0


def test_sampled_speculation_with_aborts_leaks_nothing(drafting):
    engine = drafting.engine
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7)
    ids = [engine.add_request(p, params) for p in PROMPTS[:6]]
    seqs = [s for i in ids for s in engine.sequences(i)]
    finished, counts = {}, dict.fromkeys(ids, 0)

    def step() -> None:
        for delta in engine.step():
            counts[delta.request_id] += len(delta.samples[0].token_ids)
            if delta.finished:
                finished[delta.request_id] = delta.samples[0]

    for _ in itertools.repeat(None, 6):
        step()
    assert any(s.speculation.num_drafts for s in seqs)
    for request_id in ids[::2]:  # abort mid-speculation
        engine.abort(request_id)
    while engine.has_unfinished:
        step()
        engine.check_integrity()
    assert set(finished) == set(ids)
    for request_id in ids[1::2]:
        sample, count = finished[request_id], counts[request_id]
        assert sample.finish_reason in ("stop", "length") and 0 < count <= 32
        assert sample.finish_reason == "stop" or count == 32
    engine.check_integrity()
    assert not engine.drafter.shadows


def test_bad_speculation_settings_name_the_field(smollm2_path, qwen_path):
    from ridge.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model="smollm2", speculate="draft")
    with pytest.raises(ValueError, match=r"num_speculative_tokens: must be in \[1, 16\]"):
        EngineConfig(model="smollm2", speculate="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculate: 'eagle' is not one of ngram, draft"):
        EngineConfig(model="smollm2", speculate="eagle")
    with pytest.raises(ValueError, match=r"draft_model: its vocabulary \(151\d+ tokens\) differs"):
        from ridge import LLM

        LLM(str(smollm2_path), progress=False, kv_cache_memory="64MiB", draft_model=str(qwen_path))


def test_constrained_speculation_equals_constrained_plain_decoding(drafting, smollm2):
    """Drafts are cut where the grammar refuses them and each checking row is masked by the grammar's state
    after the drafts before it: greedy output equals plain constrained decoding, sampled output follows it."""
    from ridge import StructuredOutputsParams

    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "count"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False}
    constraint = StructuredOutputsParams(json=schema)
    prompts = ["A shopping list as JSON:", "JSON of fruits and how many:"]
    greedy = SamplingParams(temperature=0, max_tokens=32, structured_outputs=constraint)
    plain = [o.outputs[0].token_ids for o in smollm2.generate(prompts, greedy)]
    outs = drafting.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics["spec_accepted_tokens"] for o in outs) > 0
    sampled = drafting.generate(prompts, SamplingParams(temperature=0.8, seed=5, max_tokens=48,
                                                   structured_outputs=constraint))
    for out in sampled:
        if out.outputs[0].finish_reason == "stop":  # a reply cut by max_tokens is a valid prefix only
            value = json.loads(out.outputs[0].text)
            assert 2 <= len(value["items"]) <= 3 and all(0 <= i["count"] <= 99 for i in value["items"])
    assert any(o.outputs[0].finish_reason == "stop" for o in sampled)
    assert sum(o.metrics["spec_accepted_tokens"] for o in sampled) > 0
