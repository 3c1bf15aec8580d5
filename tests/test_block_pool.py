import pytest

from ridge.kv.block_pool import BlockPool, NoFreeBlocks


def test_allocate_release_roundtrip():
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    pool.check_integrity([a, b])
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.release(a)
    assert pool.num_free == 3
    pool.check_integrity([b])


def test_failed_allocation_takes_nothing():
    pool = BlockPool(4, 16)
    held = pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity([held])


def test_shared_block_freed_by_last_holder():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.share(a)
    b = list(a)
    pool.release(a)
    assert pool.num_free == 2
    pool.check_integrity([b])
    pool.release(b)
    assert pool.num_free == 4
    pool.check_integrity([])


def test_integrity_check_catches_a_leak_and_a_double_free():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    with pytest.raises(AssertionError, match="refcount"):
        pool.check_integrity([])  # blocks held by nobody: a leak
    pool.release(a)
    with pytest.raises(AssertionError):
        pool.release(a)


def test_blocks_for():
    pool = BlockPool(4, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
