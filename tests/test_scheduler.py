"""The scheduler on its own: budget, decode-first order, chunking, preemption and requeueing."""

from ridge.engine.scheduler import Scheduler
from ridge.engine.sequence import Sequence, Status
from ridge.kv.block_pool import BlockPool
from ridge.sampling_params import SamplingParams


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_len=prompt_len, token_ids=list(range(prompt_len)),
                    params=SamplingParams(), text=None)


def run(sched: Scheduler, step) -> None:
    """What the engine does after a step: count computed tokens, append a token to those that sampled."""
    for s, n in zip(step.seqs, step.num_tokens, strict=True):
        s.num_computed += n
        if s.num_computed == len(s.token_ids):
            s.token_ids.append(7)


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=8, max_num_seqs=8)
    a, b = seq(0, 3), seq(1, 20)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step.num_tokens == [3, 5] and step.seqs == [a, b]  # a's prompt whole, b's first chunk
    run(sched, step)
    step = sched.schedule()
    assert step.seqs == [a, b] and step.num_tokens == [1, 7] and step.num_decodes == 1
    assert step.total_tokens <= 8
    sched.check_integrity()


def test_max_num_seqs_caps_admission():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 4))
    step = sched.schedule()
    assert len(step.seqs) == 2 and len(sched.waiting) == 1


def test_preemption_frees_blocks_and_requeues_newest_first():
    pool = BlockPool(4, 4)  # 16 tokens in all
    sched = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=8)
    old, new = seq(0, 8), seq(1, 8)
    sched.add(old)
    sched.add(new)
    run(sched, sched.schedule())  # both prompts in: all 4 blocks used, both sampled one token
    assert pool.num_free == 0
    step = sched.schedule()  # each decode needs a fifth block: the newest is preempted
    assert step.num_preempted == 1 and step.seqs == [old]
    assert new.status is Status.WAITING and new.num_computed == 0 and not new.block_table
    assert sched.waiting[0] is new
    sched.check_integrity()


def test_finish_returns_blocks_from_anywhere():
    pool = BlockPool(8, 4)
    sched = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = seq(0, 6), seq(1, 6)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, "abort")
    sched.finish(b, "stop")
    assert pool.num_free == 8 and not sched.has_work
    sched.check_integrity()
