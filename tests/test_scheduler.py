"""The scheduler on its own: budget, decode-first order, chunking, preemption and requeueing."""

import pytest

from ridge.engine.scheduler import Scheduler
from ridge.engine.sequence import Sequence, Status
from ridge.kv.manager import KVManager
from ridge.sampling_params import SamplingParams


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_len=prompt_len, token_ids=list(range(prompt_len)),
                    params=SamplingParams())


def run(sched: Scheduler, step) -> None:
    """What the engine does after a step: count computed tokens, append a token to those that sampled."""
    for s, n in zip(step.seqs, step.num_tokens, strict=True):
        s.num_computed += n
        if s.num_computed == len(s.token_ids):
            s.token_ids.append(7)


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched = Scheduler(KVManager(64, 4), max_num_batched_tokens=8, max_num_seqs=8)
    a, b = seq(0, 3), seq(1, 20)
    sched.add([a])
    sched.add([b])
    step = sched.schedule()
    assert step.num_tokens == [3, 5] and step.seqs == [a, b]  # a's prompt whole, b's first chunk
    run(sched, step)
    step = sched.schedule()
    assert step.seqs == [a, b] and step.num_tokens == [1, 7] and step.num_decodes == 1
    assert step.total_tokens <= 8
    sched.check_integrity()


def test_max_num_seqs_caps_admission():
    sched = Scheduler(KVManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add([seq(i, 4)])
    step = sched.schedule()
    assert len(step.seqs) == 2 and len(sched.waiting) == 1


def test_preemption_frees_blocks_and_requeues_newest_first():
    kv = KVManager(4, 4)  # 16 tokens in all
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    old, new = seq(0, 8), seq(1, 8)
    sched.add([old])
    sched.add([new])
    run(sched, sched.schedule())  # both prompts in: all 4 blocks used, both sampled one token
    assert kv.num_free == 0
    step = sched.schedule()  # each decode needs a fifth block: the newest is preempted
    assert step.num_preempted == 1 and step.seqs == [old]
    assert new.status is Status.WAITING and new.num_computed == 0 and not any(new.block_tables)
    assert sched.waiting[0] is new
    sched.check_integrity()


def test_a_preempted_sequence_comes_back_when_it_fits_whole():
    """Readmitted on its next chunk's room it would prefill beside the one that preempted it until that one grows
    into the blocks again; it waits while others run and the pool cannot hold all its tokens."""
    kv = KVManager(6, 4)  # 24 tokens
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    old, new = seq(0, 8), seq(1, 12)
    sched.add([old])
    sched.add([new])
    free_after_preemption = None
    for _ in range(6):
        step = sched.schedule()
        if free_after_preemption is not None:
            assert new not in step.seqs  # 13 tokens need 4 blocks
        run(sched, step)
        if step.num_preempted:
            free_after_preemption = kv.num_free
    assert free_after_preemption == 3  # its first chunk's 2 blocks would have fitted
    assert new.status is Status.WAITING and new.num_preemptions == 1
    sched.finish(old, "stop")
    step = sched.schedule()
    assert step.seqs == [new] and step.num_tokens == [8]
    sched.check_integrity()


def test_finish_returns_blocks_from_anywhere():
    kv = KVManager(8, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = seq(0, 6), seq(1, 6)
    sched.add([a])
    sched.add([b])
    sched.schedule()
    sched.finish(a, "abort")
    sched.finish(b, "stop")
    assert kv.num_free == 8 and not sched.has_work
    sched.check_integrity()


def test_update_appends_checks_token_stops_and_settles_drafts():
    from ridge.engine.scheduler import Sampled, StopRule

    kv = KVManager(16, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, stops=StopRule(frozenset({99}), 12))
    eos, long = seq(0, 4), seq(1, 4)
    eos.params = SamplingParams(max_tokens=50)
    sched.add([eos])
    sched.add([long])
    step = sched.schedule()
    assert sched.update(step, [Sampled(eos, [99]), Sampled(long, [5])]) == 2
    assert eos.finished and eos.finish_reason == "stop" and eos.stop_reason == 99 and not any(eos.block_tables)
    assert long.num_computed == 4 and long.token_ids[-1] == 5 and long.timings.first_token is not None
    long.draft_ids = [6, 7, 8]  # drafts checked in the next pass: 2 accepted, then the target's own token
    step = sched.schedule()
    assert step.num_tokens == [4]
    sched.update(step, [Sampled(long, [6, 7, 9])])
    assert long.token_ids[4:] == [5, 6, 7, 9] and long.num_computed == 7 and long.draft_ids == []
    assert len(long.block_tables[0]) == 2  # the rejected draft's block went back
    sched.check_integrity()
    long.draft_ids = [1, 2, 3, 4]
    step = sched.schedule()
    assert sched.update(step, [Sampled(long, [1, 2, 3, 4, 5])]) == 4  # the 4th reaches max_model_len (12)
    assert long.finished and long.finish_reason == "length" and len(long.token_ids) == 12
    assert kv.num_free == 16 and not sched.has_work


def test_held_siblings_wait_for_the_first_sample_and_never_strand():
    from ridge.engine.scheduler import Sampled

    kv = KVManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    samples = [seq(i, 10) for i in range(3)]
    sched.add(samples)
    step = sched.schedule()
    assert step.seqs == [samples[0]]  # the siblings wait until the prompt is cached
    sched.update(step, [Sampled(samples[0], [1])])
    step = sched.schedule()
    assert samples[1] in step.seqs and samples[2] in step.seqs
    assert samples[1].num_cached_tokens == 8  # two full prompt blocks found cached
    for s in samples:
        sched.finish(s, "abort")
    # a first sample that ends before its first token releases its siblings, which then run or end normally
    again = [seq(i, 10) for i in range(10, 13)]
    sched.add(again)
    sched.schedule()
    sched.finish(again[0], "abort")
    assert list(sched.waiting) == again[1:]
    sched.finish(again[1], "abort")
    sched.finish(again[2], "abort")
    assert not sched.has_work and not sched.held
    sched.check_integrity()
    kv.check_idle()


def ranked(i: int, prompt_len: int, priority: int) -> Sequence:
    s = seq(i, prompt_len)
    s.priority = priority
    return s


def test_priority_orders_the_queue_by_priority_then_arrival():
    sched = Scheduler(KVManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2, policy="priority")
    late_urgent, early_low, early_urgent = ranked(2, 4, 0), ranked(0, 4, 5), ranked(1, 4, 0)
    for s in (early_low, early_urgent, late_urgent):
        sched.add([s])
    step = sched.schedule()
    assert step.seqs == [early_urgent, late_urgent] and list(sched.waiting) == [early_low]
    sched.check_integrity()


def test_priority_preempts_the_least_important_not_the_newest():
    """Out of blocks, fcfs preempts the newest running sequence; priority the one of the largest priority value,
    here the oldest."""
    kv = KVManager(4, 4)  # 16 tokens
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, policy="priority")
    low, urgent = ranked(0, 8, 3), ranked(1, 8, 1)
    sched.add([low])
    sched.add([urgent])
    run(sched, sched.schedule())
    step = sched.schedule()  # each decode needs a fifth block
    assert step.num_preempted == 1 and step.seqs == [urgent]
    assert low.status is Status.WAITING and not any(low.block_tables) and sched.waiting[0] is low
    sched.check_integrity()


def test_an_urgent_arrival_displaces_a_less_important_running_sequence():
    """max_num_seqs full of less important work: an arrival of a smaller priority value preempts the least
    important one at admission; that one's decode, scheduled earlier in the same step, leaves the step (and its
    tokens go back to the budget). One of equal priority waits its turn."""
    kv = KVManager(64, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=2, policy="priority")
    a, b = ranked(0, 6, 1), ranked(1, 6, 2)
    sched.add([a])
    sched.add([b])
    run(sched, sched.schedule())
    same = ranked(2, 6, 2)
    sched.add([same])
    step = sched.schedule()
    assert step.seqs == [a, b] and step.num_preempted == 0  # as important as b: it waits
    run(sched, step)
    urgent = ranked(3, 6, 0)
    sched.add([urgent])
    step = sched.schedule()
    # the urgent one displaces b (priority 2), whose decode was scheduled first; `same` waits behind b
    assert step.seqs == [a, urgent] and step.num_tokens == [1, 6] and step.num_preempted == 1
    assert b.status is Status.WAITING and list(sched.waiting) == [b, same]
    assert not any(b.block_tables) and b.num_computed == 0
    sched.check_integrity()


def test_priority_policy_refuses_nothing_else_and_other_policies_refuse_priorities():
    from ridge.engine.scheduler import check_priority

    check_priority("priority", -3)
    check_priority("fcfs", 0)
    for policy in ("fcfs", "lpm"):
        with pytest.raises(ValueError, match=f"priority: 2 asked for, but this engine schedules by {policy}"):
            check_priority(policy, 2)
    with pytest.raises(ValueError, match="priority: must be an integer"):
        check_priority("priority", 1.5)
