"""Prefix caching: the cache and pool alone, then the engine with the cache on against it off."""

from __future__ import annotations

import pytest
import torch

from ridge import SamplingParams
from ridge.engine.scheduler import Scheduler
from ridge.engine.sequence import Sequence
from ridge.kv.block_pool import BlockPool, NoFreeBlocks
from ridge.kv.manager import KVManager
from ridge.kv.prefix_cache import PrefixCache, chain_key


def _seq(i: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_len=len(tokens), token_ids=list(tokens),
                    params=SamplingParams(cache_salt=salt))


def _prefill(sched: Scheduler, seq: Sequence) -> int:
    """Admit seq and compute its whole prompt; return how many tokens were computed (not taken from the cache)."""
    sched.add([seq])
    computed = 0
    while seq.num_pending:
        step = sched.schedule()
        for s, n in zip(step.seqs, step.num_tokens, strict=True):
            sched.kv.commit(s, n)
            if s is seq:
                computed += n
    return computed


def test_keys_chain_content_and_salt():
    a = chain_key(None, [1, 2, 3, 4])
    assert a == chain_key(None, [1, 2, 3, 4])
    assert a != chain_key(None, [1, 2, 3, 5])
    assert a != chain_key(None, [1, 2, 3, 4], salt="tenant-a")
    assert chain_key(a, [5, 6]) != chain_key(chain_key(None, [0, 2, 3, 4]), [5, 6])  # the parent matters


def test_parked_blocks_count_as_free_and_are_evicted_lru():
    cache = PrefixCache()
    pool = BlockPool(4, 4, cache)
    a, b = pool.allocate(2)
    cache.insert(b"a", a)
    cache.insert(b"b", b)
    pool.release([a])  # parked, still cached
    pool.release([b])
    assert pool.num_free == 4 and cache.num_parked == 2
    pool.check_integrity([])
    assert cache.lookup([b"a", b"b"]) == [a, b]
    pool.share([b])  # taken back: b is the most recently used now
    pool.release([b])
    fresh = pool.allocate(3)  # 2 free blocks, then the least recently used parked one: a
    assert a in fresh and b not in fresh and cache.stats.evictions == 1
    assert cache.lookup([b"a"]) == [] and cache.lookup([b"b"]) == [b]
    pool.check_integrity([fresh])


def test_eviction_never_takes_a_held_block():
    cache = PrefixCache()
    pool = BlockPool(2, 4, cache)
    held = pool.allocate(2)
    cache.insert(b"x", held[0])
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert cache.lookup([b"x"]) == [held[0]]
    pool.check_integrity([held])


@pytest.mark.parametrize("prompt_len, expect_cached", [(21, 20), (20, 16), (4, 0)])
def test_a_hit_always_leaves_the_last_token_to_compute(prompt_len, expect_cached):
    """21 tokens: 5 full blocks cached; 20 (ends on a block boundary): the block holding the last token is
    recomputed; 4: nothing to reuse."""
    sched = Scheduler(KVManager(32, 4, enable_prefix_caching=True), max_num_batched_tokens=64, max_num_seqs=8)
    tokens = list(range(100, 100 + prompt_len))
    first = _seq(0, tokens)
    assert _prefill(sched, first) == prompt_len
    sched.finish(first, "stop")
    again = _seq(1, tokens)
    assert _prefill(sched, again) == prompt_len - expect_cached
    assert again.num_cached_tokens == expect_cached
    assert sched.cache.stats.hits == expect_cached and sched.cache.stats.queries == 2 * prompt_len
    sched.finish(again, "stop")
    sched.check_integrity()


def test_a_different_salt_shares_nothing():
    sched = Scheduler(KVManager(32, 4, enable_prefix_caching=True), max_num_batched_tokens=64, max_num_seqs=8)
    tokens = list(range(40))
    for i, salt in enumerate(["a", "b", "a", None]):
        seq = _seq(i, tokens, salt)
        _prefill(sched, seq)
        assert seq.num_cached_tokens == (36 if salt == "a" and i == 2 else 0), salt
        sched.finish(seq, "stop")
    sched.check_integrity()


def test_lpm_admits_the_longest_cached_prefix_first_with_a_bounded_wait():
    from ridge.engine import scheduler as scheduler_module

    sched = Scheduler(KVManager(64, 4, enable_prefix_caching=True), max_num_batched_tokens=24, max_num_seqs=8,
                      policy="lpm")
    cached = list(range(200, 220))
    warm = _seq(0, cached)
    _prefill(sched, warm)
    sched.finish(warm, "stop")
    cold, hit = _seq(1, list(range(300, 320))), _seq(2, cached + [1, 2])
    sched.add([cold])
    sched.add([hit])
    step = sched.schedule()
    assert step.seqs[0] is hit and hit.num_cached_tokens == 20  # 5 of its 22 tokens' blocks were cached
    assert cold.times_passed == (0 if cold in step.seqs else 1)
    for s, n in zip(step.seqs, step.num_tokens, strict=True):
        sched.kv.commit(s, n)
    # a cold sequence that has waited too long goes before any cached one
    starving, another_hit = _seq(3, list(range(400, 420))), _seq(4, cached + [5])
    starving.times_passed = scheduler_module.STARVATION_LIMIT
    sched.add([another_hit])
    sched.add([starving])
    sched._rank_waiting()
    assert list(sched.waiting).index(starving) < list(sched.waiting).index(another_hit)
    with pytest.raises(ValueError, match="schedule_policy"):
        Scheduler(KVManager(4, 4), 8, 8, policy="sjf")


# ---- the engine: cache on equals cache off -----------------------------------------------------------
@pytest.fixture(scope="module")
def engines(make_llm, smollm2_path):
    on = make_llm(smollm2_path, dtype="float32")
    off = make_llm(smollm2_path, dtype="float32", enable_prefix_caching=False)
    assert on.engine.pool.cache is not None and off.engine.pool.cache is None
    return on, off


def _tokens(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


LONG = ("The history of computing is a story of moving data: from punched cards to magnetic drums, from core "
        "memory to DRAM, every generation of machines was shaped by how quickly numbers could reach the unit "
        "that combined them. Engineers learned to keep the working set close, to reuse what was fetched, and to "
        "overlap fetching with computing. ")


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_shared_prefixes_mid_block_and_on_a_boundary(engines):
    on, off = engines
    base = _tokens(on, LONG * 2)
    assert len(base) > 100
    prompts = [base[:37] + [13, 42], base[:48] + [99], base[:64], base[:64] + base[5:9], base]
    for prompt in prompts:  # one at a time, so each finds the ones before it in the cache
        got = on.generate(prompt, _greedy())[0]
        assert got.outputs[0].token_ids == off.generate(prompt, _greedy())[0].outputs[0].token_ids
    assert got.num_cached_tokens > 0
    again = on.generate(base, _greedy())[0]  # a full-prompt hit: all but the last block from the cache
    assert again.num_cached_tokens == (len(base) - 1) // 16 * 16
    assert again.outputs[0].token_ids == got.outputs[0].token_ids
    on.engine.check_integrity()


def test_same_blocks_at_another_place_are_not_shared(engines):
    """A block is found by everything before it, not by its own tokens: the same text after another first
    block, or at the start of the prompt, must be computed afresh (its K/V depend on its place)."""
    on, off = engines
    head = _tokens(on, "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron")[:16]
    tail = _tokens(on, "Unseen words: " + LONG)[:64]  # no other test caches this text at the start
    other = _tokens(on, "One two three four five six seven eight nine ten eleven twelve thirteen fourteen")[:16]
    for prompt in (head + tail, other + tail, tail, tail[16:]):
        got = on.generate(prompt, _greedy(12))[0]
        assert got.outputs[0].token_ids == off.generate(prompt, _greedy(12))[0].outputs[0].token_ids
        assert got.num_cached_tokens == 0


def test_batch_with_a_common_system_prompt(engines, monkeypatch):
    """Ten requests over one ~300-token system prompt: their decodes share its blocks, and attend to them
    once, together (cascade attention), as well as each on its own."""
    from ridge.attention import cascade

    on, off = engines
    shared_rows = []

    def spy(*args, **kwargs):
        prefixes, tables, lens = split(*args, **kwargs)
        shared_rows.extend(len(p.rows) for p in prefixes)
        return prefixes, tables, lens

    split = cascade.split_shared_prefixes
    monkeypatch.setattr(cascade, "split_shared_prefixes", spy)
    system = _tokens(on, "You are a careful assistant. " + LONG * 4)
    assert len(system) >= cascade.MIN_SHARED_TOKENS + 16
    prompts = [system + _tokens(on, f" Question {i}: what is {i} squared?") for i in range(10)]
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, _greedy(16))]
    assert not shared_rows  # no cache, no shared blocks
    on.generate(prompts[:1], _greedy(1))  # warm the cache with the shared part
    got = on.generate(prompts, _greedy(16))
    assert [o.outputs[0].token_ids for o in got] == expected
    assert all(o.num_cached_tokens >= len(system) // 16 * 16 - 16 for o in got)
    assert max(shared_rows) == 10


def test_n_samples_share_the_prompt(engines):
    on, off = engines
    prompt = _tokens(on, LONG)
    for params in (_greedy(12, n=3), SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)):
        hits_before = on.engine.pool.cache.stats.hits
        got = on.generate(prompt, params)[0].outputs
        want = off.generate(prompt, params)[0].outputs
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        # samples 1 and 2 reuse every full block of the prompt that sample 0 computed
        assert on.engine.pool.cache.stats.hits - hits_before >= 2 * ((len(prompt) - 1) // 16 * 16)
    on.engine.check_integrity()


def test_eviction_and_preemption_under_a_small_pool(make_llm_for_test, smollm2_path, engines):
    _, off = engines
    # 18 blocks of 16 tokens (float32)
    small = make_llm_for_test(smollm2_path, dtype="float32", kv_cache_memory="13MiB")
    assert small.engine.pool.num_blocks == 18
    cache = small.engine.pool.cache
    shared = _tokens(small, LONG)
    prompts = [shared + _tokens(small, f" Part {i}.") for i in range(8)]
    params = _greedy(32)  # 8 x 7 blocks, 4 of them shared: 28 blocks > 18
    got = small.generate(prompts, params)
    want = off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics["num_preemptions"] for o in got) > 0, "the pool was large enough: no preemption tested"
    assert cache.stats.evictions > 0, "nothing was evicted"
    small.engine.check_integrity()
    for prompt in prompts[:3]:  # after the churn the cache still gives right answers
        assert small.generate(prompt, _greedy(8))[0].outputs[0].token_ids == \
            off.generate(prompt, _greedy(8))[0].outputs[0].token_ids
    small.engine.check_integrity()


def test_cache_salt_isolates_requests(engines):
    on, _ = engines
    prompt = _tokens(on, "Tenant data: " + LONG)
    first = on.generate(prompt, _greedy(4, cache_salt="tenant-a"))[0]
    other = on.generate(prompt, _greedy(4, cache_salt="tenant-b"))[0]
    same = on.generate(prompt, _greedy(4, cache_salt="tenant-a"))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert same.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


# ---- beam search: forks are prompts whose blocks the cache already holds ------------------------------
def _reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, stop_ids: frozenset[int],
                           length_penalty: float) -> list[int]:
    """The same search written plainly over HF transformers' full-sequence logits (no cache of any kind; the
    live beams, all of one length, in one batch)."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        with torch.no_grad():
            beams = torch.tensor([prompt + tokens for tokens, _ in live])
            logits = model(beams, logits_to_keep=1).logits[:, -1].float()  # the last position's alone
        for (tokens, total), logprobs in zip(live, torch.log_softmax(logits, -1), strict=True):
            top = torch.topk(logprobs, 2 * width)
            candidates += [(tokens + [t], total + lp) for lp, t in zip(top.values.tolist(), top.indices.tolist(),
                                                                        strict=True)]
        best = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
        done += [c for c in best if c[0][-1] in stop_ids]
        live = [c for c in best if c[0][-1] not in stop_ids]
        if not live:
            break

    def final(c: tuple[list[int], float]) -> float:
        length = len(c[0]) - (1 if c[0][-1] in stop_ids else 0)
        return c[1] / max(length, 1) ** length_penalty

    return max(done + live, key=final)[0]


def test_beam_search_matches_a_reference_over_hf_logits(engines, hf_smollm2):
    from ridge import BeamSearchParams

    on, off = engines
    prompts = ["The three most important inventions are", "def add(a, b):"]
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=1.0)
    hits_before = on.engine.pool.cache.stats.hits
    outputs = on.beam_search(prompts, params)
    assert on.engine.pool.cache.stats.hits - hits_before > 0, "beams did not share their parents' blocks"
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = on.tokenizer.encode(prompt)
        expected = _reference_beam_search(hf_smollm2, ids, 4, 12, on.tokenizer.stop_token_ids, 1.0)
        best = out.sequences[0]
        assert best.token_ids == expected, (on.tokenizer.decode(best.token_ids), on.tokenizer.decode(expected))
        assert len(out.sequences) == 4 and [h.score for h in out.sequences] == sorted(
            (h.score for h in out.sequences), reverse=True)
        # its cumulative log-probability is what scoring the whole sequence in one pass gives
        logprobs = torch.log_softmax(on.engine.prompt_logits(ids + best.token_ids), -1)
        rescored = sum(logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(best.token_ids))
        assert best.cumulative_logprob == pytest.approx(rescored, abs=1e-3)
    # without the cache every beam recomputes its whole prefix: the same hypotheses
    plain = off.beam_search(prompts[1], params)[0]
    assert [h.token_ids for h in plain.sequences] == [h.token_ids for h in outputs[1].sequences]
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
