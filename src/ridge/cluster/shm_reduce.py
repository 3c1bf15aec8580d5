"""The all-reduce of ranks on one machine through shared memory, where gloo would go through loopback TCP.

Through gloo, a small all-reduce between two processes of one host is mostly loopback TCP and the wake-up of
gloo's threads (docs/notes/tensor-parallel.md measures both); through shared memory it is a copy in, a wait for
the others' flags and a sum. vLLM's CPU backend and SGLang's do the same in C++; here numpy views of one shared
segment do it: the work is a few copies of a few kilobytes, and the wait is a loop over ranks' flags.

The segment holds a flag per rank, then two buffers of a slot per rank. Call s of the group (every rank makes the
same calls in the same order) writes buffer s % 2: a rank copies its tensor into its slot, then sets its flag to s
(x86 keeps stores in order, so a flag is never seen before the data it announces), waits until every flag reaches
s, and sums the slots in rank order: every rank sums the same numbers in the same order, as an all-reduce must.
Two buffers make one wait enough: a rank writes buffer s % 2 again at call s + 2 only after every rank has set its
flag for call s + 1, so after each has finished reading call s. A wait checks, every few milliseconds, that the
other ranks' processes still live, so a rank that died fails the step at once, as a closed socket does in gloo.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # per rank and buffer: larger tensors (long prefills' activations) go through gloo
LIVENESS_CHECK_S = 0.005
# a wait spins this long (ten ring steps of ranks that both run), then yields the core at every turn: a longer
# wait means the rank waited for may be off its core, needing this one (docs/notes/tensor-parallel.md)
SPIN_S = 50e-6


class SharedMemoryReducer:
    def __init__(self, segment: shared_memory.SharedMemory, rank: int, size: int, pids: list[int],
                 owner: bool, timeout_s: float) -> None:
        self.segment, self.rank, self.size, self.pids, self.owner = segment, rank, size, pids, owner
        self.timeout_s = timeout_s
        # more ranks than cores: a spinning rank would hold a core the rank it waits for needs
        self.yield_always = size > (os.cpu_count() or 1)
        self.flags = np.ndarray((size,), dtype=np.int64, buffer=segment.buf)
        self.data = np.ndarray((2, size, SLOT_BYTES), dtype=np.uint8, buffer=segment.buf, offset=64 * size)
        self.calls = 0

    @staticmethod
    def usable(hosts: list[str]) -> bool:
        """Whether the ranks (on these hosts) can reduce through shared memory: one machine, of x86's store
        order (which the flags rely on)."""
        return len(set(hosts)) == 1 and platform.machine() in ("x86_64", "AMD64")

    @staticmethod
    def host() -> str:
        return socket.gethostname()

    @classmethod
    def create(cls, size: int, pids: list[int], timeout_s: float) -> SharedMemoryReducer:
        """Rank 0's: the segment, zeroed."""
        segment = shared_memory.SharedMemory(create=True, size=64 * size + 2 * size * SLOT_BYTES)
        np.ndarray((size,), dtype=np.int64, buffer=segment.buf)[:] = 0
        return cls(segment, 0, size, pids, owner=True, timeout_s=timeout_s)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, pids: list[int], timeout_s: float) -> SharedMemoryReducer:
        segment = shared_memory.SharedMemory(name=name)
        # rank 0 owns the segment; this process's resource tracker would otherwise unlink it at exit
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 - Python 3.11 has no track=False
        return cls(segment, rank, size, pids, owner=False, timeout_s=timeout_s)

    def track(self) -> None:
        """Rank 0's, once every rank has attached: register the segment with this process's resource tracker again
        (a set of names), so that it unlinks the segment should rank 0 die. Ranks forked from this machine's fork
        server share rank 0's tracker, and an attaching rank's unregistering (sent before its ok) removed the name
        rank 0 had registered."""
        resource_tracker.register(self.segment._name, "shared_memory")  # noqa: SLF001

    @property
    def name(self) -> str:
        return self.segment.name

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.nbytes <= SLOT_BYTES and tensor.device.type == "cpu"

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (contiguous, fits()) over the ranks, in place."""
        self.calls += 1
        call, n = self.calls, tensor.nbytes
        slots = self.data[call % 2, :, :n]
        slots[self.rank] = tensor.view(-1).view(torch.uint8).numpy()
        self.flags[self.rank] = call
        self._wait(call)
        pieces = torch.from_numpy(slots).view(tensor.dtype).view(self.size, *tensor.shape)
        torch.sum(pieces, dim=0, out=tensor)

    def _wait(self, call: int) -> None:
        started = checked = time.monotonic()
        while (self.flags < call).any():
            now = time.monotonic()
            if self.yield_always or now - started > SPIN_S:
                os.sched_yield()
            if now - checked > LIVENESS_CHECK_S:
                checked = now
                self._check_peers(call, now - started)

    def _check_peers(self, call: int, waited: float) -> None:
        for rank, pid in enumerate(self.pids):
            if rank != self.rank and self.flags[rank] < call and not _alive(pid):
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {pid}) died during an all-reduce")
        if waited > self.timeout_s:
            late = [r for r in range(self.size) if self.flags[r] < call]
            raise RuntimeError(f"tensor-parallel ranks {late} did not reach an all-reduce in {waited:.0f} s")
        os.sched_yield()  # more ranks than cores: let the one being waited for run

    def close(self) -> None:
        self.flags = self.data = None  # the views first: the segment cannot close under them
        self.segment.close()
        if self.owner:
            self.segment.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: alive
        return True
    return True
