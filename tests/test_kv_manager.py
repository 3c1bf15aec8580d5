"""The KV manager on its own: the one owner of block tables, and the integrity check that guards them."""

import pytest

from ridge.engine.sequence import Sequence
from ridge.kv.manager import KVManager
from ridge.sampling_params import SamplingParams


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_len=len(tokens), token_ids=list(tokens),
                    params=SamplingParams())


def test_reserve_commit_trim_free():
    kv = KVManager(8, 4)
    s = seq(0, list(range(6)))
    assert kv.reserve(s, 6) and len(s.block_tables[0]) == 2
    kv.commit(s, 6)
    assert s.num_computed == 6
    assert kv.reserve(s, 6 + 5) and len(s.block_tables[0]) == 3  # room for drafts
    kv.trim(s)  # the drafts were rejected: back to the blocks its 6 tokens need
    assert len(s.block_tables[0]) == 2 and kv.num_free == 6
    kv.check_integrity([s])
    assert not kv.reserve(s, 100) and len(s.block_tables[0]) == 2  # a failed reservation takes nothing
    kv.free(s)
    assert s.block_tables == [[]] and s.num_computed == 0
    kv.check_idle()


def test_cached_prefix_is_shared_and_never_covers_the_last_token():
    kv = KVManager(16, 4, enable_prefix_caching=True)
    first = seq(0, list(range(12)))
    kv.reserve(first, 12)
    kv.commit(first, 12)  # 3 full blocks registered
    second = seq(1, list(range(12)))
    assert kv.cached_prefix_len(second) == 8  # the block holding the last token is computed again
    kv.take_cached_prefix(second)
    assert second.num_computed == 8 and second.block_tables[0] == first.block_tables[0][:2]
    kv.reserve(second, 12)
    assert second.block_tables[0][2] != first.block_tables[0][2]  # the block it writes is its own
    kv.check_integrity([first, second])
    kv.free(first)
    kv.free(second)
    kv.check_idle()  # cached blocks no one holds count as free


def test_rewind_refuses_cached_kv():
    kv = KVManager(8, 4, enable_prefix_caching=True)
    s = seq(0, list(range(9)))
    kv.reserve(s, 9)
    kv.commit(s, 9)
    kv.rewind(s, 8)  # the partial block's K/V only
    assert s.num_computed == 8
    with pytest.raises(AssertionError, match="cached"):
        kv.rewind(s, 5)
    kv.free(s)


def test_integrity_check_catches_what_it_guards():
    kv = KVManager(8, 4)
    a, b = seq(0, list(range(8))), seq(1, list(range(4)))
    kv.reserve(a, 8)
    with pytest.raises(AssertionError, match="refcount"):
        kv.check_integrity([])  # a's blocks are held by no table the check was shown
    with pytest.raises(AssertionError, match="waiting"):
        kv.check_integrity([], [a])
    a.num_computed = 9  # more K/V than its table can hold
    with pytest.raises(AssertionError, match="computed"):
        kv.check_integrity([a])
    a.num_computed = 0
    kv.reserve(b, 4)
    with pytest.raises(AssertionError, match="leaked"):
        kv.free(a)
        kv.check_idle()  # b still holds a block
    kv.free(b)
    kv.check_idle()


def test_scratch_blocks_come_back():
    kv = KVManager(4, 4)
    with pytest.raises(RuntimeError), kv.scratch(10) as (tables, slot):
        assert [len(t) for t in tables] == [3] and kv.num_free == 1 and slot is None
        raise RuntimeError("a forward pass that fails")
    kv.check_idle()


def test_state_slots_go_with_the_blocks():
    """A model with recurrent state: a sequence takes a slot with its first reservation and gives it back when
    freed; one that finds no free slot gets nothing (no block either) and waits."""
    kv = KVManager(8, 4, num_state_slots=2)
    a, b, c = (seq(i, list(range(6))) for i in range(3))
    assert kv.reserve(a, 6) and kv.reserve(b, 6) and {a.state_slot, b.state_slot} == {0, 1}
    assert kv.reserve(a, 7) and a.state_slot in (0, 1)  # growing keeps its slot
    free = kv.num_free
    assert not kv.reserve(c, 6) and c.state_slot is None and kv.num_free == free
    kv.check_integrity([a, b], [c])
    kv.free(a)
    assert kv.reserve(c, 6) and c.state_slot is not None
    with pytest.raises(ValueError, match="no free state slot"), kv.scratch(4):
        pass  # scoring a text needs a slot too: none is free
    kv.free(b)
    with kv.scratch(4) as (_, slot):
        assert slot is not None and slot != c.state_slot
    kv.free(c)
    kv.check_idle()
    with pytest.raises(AssertionError, match="released twice"):
        kv.states.release(0)
