"""The shared-memory all-reduce of tensor-parallel ranks on one machine (cluster/shm_reduce.py), between two
processes: sums equal the local ones in float32 and bfloat16, the buffers reused call after call, and a rank whose
peer died fails its all-reduce at once rather than waiting. (The engine's tensor-parallel tests run through it
too: tests/test_tensor_parallel.py.)"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from ridge.cluster.shm_reduce import SharedMemoryReducer

pytestmark = pytest.mark.skipif(not SharedMemoryReducer.usable([SharedMemoryReducer.host()]),
                                 reason="shared-memory reduction needs x86's store order")


def tensors(rank: int) -> list[torch.Tensor]:
    """What rank `rank` reduces, call after call: more calls than the two buffers, of several shapes and dtypes."""
    base = [torch.arange(15, dtype=torch.float32).view(3, 5) / 7, torch.linspace(-2, 2, 9).bfloat16(),
            torch.full((4096,), 0.25)]
    return [t * (rank + 1) for _ in range(3) for t in base]


def peer(name: str, parent: int, result: multiprocessing.Queue, participate: bool) -> None:
    local = SharedMemoryReducer.attach(name, 1, 2, [parent, os.getpid()], timeout_s=30)
    try:
        if participate:
            sums = []
            for t in tensors(1):
                local.all_reduce_(t)
                sums.append(t)
            result.put([s.float().tolist() for s in sums])
    finally:
        local.close()


def test_two_processes_sum_what_each_holds():
    context = multiprocessing.get_context("spawn")
    local = SharedMemoryReducer.create(2, [os.getpid(), 0], timeout_s=30)
    result = context.Queue()
    child = context.Process(target=peer, args=(local.name, os.getpid(), result, True))
    child.start()
    local.pids[1] = child.pid
    try:
        mine = []
        for t in tensors(0):
            local.all_reduce_(t)
            mine.append(t)
        theirs = result.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        local.close()
    for ours, peers, a, b in zip(mine, theirs, tensors(0), tensors(1), strict=True):
        assert torch.equal(ours, a + b)  # each rank's sum is the local one, bit for bit
        assert ours.float().tolist() == peers


def test_a_dead_peer_fails_the_all_reduce_at_once():
    context = multiprocessing.get_context("spawn")
    local = SharedMemoryReducer.create(2, [os.getpid(), 0], timeout_s=600)
    child = context.Process(target=peer, args=(local.name, os.getpid(), context.Queue(), False))
    child.start()
    local.pids[1] = child.pid
    child.join(timeout=60)  # attached and left without taking part
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died during an all-reduce"):
            local.all_reduce_(torch.ones(8))
    finally:
        local.close()
    assert time.monotonic() - started < 5
