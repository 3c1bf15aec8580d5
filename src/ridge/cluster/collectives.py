"""A tensor-parallel group of processes over torch.distributed, and the model layers that talk through it.

Two gloo process groups share one rendezvous store: `compute` carries the collectives inside
a step (an all-reduce after each attention and each MLP, the embedding's all-reduce and the logits' gather), with a
timeout that catches a wedged rank; `commands` carries rank 0's step descriptions to the workers, which wait on it
while the engine is idle, for as long as it stays idle. A rank that dies closes its sockets, and the others' next
collective fails at once rather than at a timeout. Ranks of one machine run their small all-reduces (a decode step's)
through shared memory instead (cluster/shm_reduce.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ridge.cluster.shards import ShardPlan
from ridge.cluster.shm_reduce import SharedMemoryReducer

log = logging.getLogger("ridge")

GATHER_LIMIT = 1 << 20  # bytes: smaller all-reduces run as an all-gather and a local sum
STEP_TIMEOUT = timedelta(minutes=10)  # one step's collectives: a long prefill of a big model on a CPU, at most
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step while the engine has none to run


@dataclass
class CollectiveClock:
    """Time spent in a rank's step collectives (from the call to its completion, waits for slower ranks
    included), for `ridge bench tp`."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


@dataclass
class TPGroup:
    rank: int
    size: int
    compute: dist.ProcessGroup
    commands: dist.ProcessGroup
    clock: CollectiveClock = field(default_factory=CollectiveClock)
    local: SharedMemoryReducer | None = None  # ranks of one machine: small all-reduces through shared memory

    @classmethod
    def join(cls, url: str, rank: int | None = None, size: int | None = None, timeout_s: float = 120.0) -> TPGroup:
        """Rendezvous at `url` (tcp://host:port, or env:// for torchrun's MASTER_ADDR / MASTER_PORT / RANK /
        WORLD_SIZE): this process as `rank` of `size`."""
        kwargs = {} if rank is None else {"rank": rank, "world_size": size}
        store, rank, size = next(dist.rendezvous(url, timeout=timedelta(seconds=timeout_s), **kwargs))
        store.set_timeout(IDLE_TIMEOUT)
        group = cls(rank, size, dist.ProcessGroupGloo(dist.PrefixStore("compute", store), rank, size, STEP_TIMEOUT),
                    dist.ProcessGroupGloo(dist.PrefixStore("commands", store), rank, size, IDLE_TIMEOUT))
        group.local = _shared_memory(store, rank, size)
        return group

    def close(self) -> None:
        """Release what the group holds outside its process groups (the shared-memory segment)."""
        if self.local is not None:
            self.local.close()
            self.local = None

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum tensor over the ranks, in place. Up to GATHER_LIMIT bytes (every decode step's), as an all-gather
        and a sum here: gloo's all-reduce of small messages is several times slower than its all-gather
        (docs/notes/tensor-parallel.md). Every rank sums the same pieces in the same order, so all hold the same
        result, as an all-reduce guarantees."""
        start = time.perf_counter()
        if self.local is not None and self.local.fits(tensor) and tensor.is_contiguous():
            self.local.all_reduce_(tensor)  # every rank makes the same choice: their tensors are alike
        elif tensor.nbytes <= GATHER_LIMIT:
            pieces = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype)
            self.compute._allgather_base(pieces.view(-1), tensor.contiguous().view(-1)).wait()
            torch.sum(pieces, dim=0, out=tensor)
        else:
            self.compute.allreduce([tensor]).wait()
        self._count(start, tensor)

    def gather_on_first(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (all of one shape), on rank 0; [] on the others."""
        start = time.perf_counter()
        options = dist.GatherOptions()
        options.rootRank = 0
        pieces = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        self.compute.gather([pieces] if self.rank == 0 else [], [tensor.contiguous()], options).wait()
        self._count(start, tensor)
        return pieces

    def _count(self, start: float, tensor: torch.Tensor) -> None:
        self.clock.calls += 1
        self.clock.seconds += time.perf_counter() - start
        self.clock.bytes += tensor.nbytes

    def time_all_reduce(self, numel: int, repeats: int) -> float:
        """The median seconds of all_reduce_ of numel float32 values (every rank calls it alike)."""
        tensor = torch.ones(numel)
        times = []
        for _ in range(repeats + 3):  # three to warm the connections
            start = time.perf_counter()
            self.all_reduce_(tensor)
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])

    def broadcast_command(self, command: Any = None) -> Any:
        """Rank 0's command (pickled), on every rank: its length, then its bytes."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        data = pickle.dumps(command) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.long)
        self.commands.broadcast([length], options).wait()
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                  else torch.empty(int(length), dtype=torch.uint8))
        self.commands.broadcast([buffer], options).wait()
        return command if self.rank == 0 else pickle.loads(buffer.numpy().tobytes())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's object (pickled), on rank 0 in rank order; [] on the others."""
        data = pickle.dumps(obj)
        lengths = torch.zeros(self.size, dtype=torch.long)
        lengths[self.rank] = len(data)
        self.commands.allreduce([lengths]).wait()  # every rank pads to the longest
        buffer = torch.zeros(int(lengths.max()), dtype=torch.uint8)
        buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        options = dist.GatherOptions()
        options.rootRank = 0
        pieces = [torch.empty_like(buffer) for _ in range(self.size)] if self.rank == 0 else []
        self.commands.gather([pieces] if self.rank == 0 else [], [buffer], options).wait()
        return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(pieces, lengths.tolist(), strict=False)]

    def all_ok(self, ok: bool) -> list[bool]:
        """Each rank's ok, on every rank (each rank's outcome of a phase that may fail on one of them)."""
        flags = torch.zeros(self.size, dtype=torch.long)
        flags[self.rank] = int(ok)
        self.commands.allreduce([flags]).wait()
        return [bool(f) for f in flags.tolist()]


def _shared_memory(store: dist.Store, rank: int, size: int) -> SharedMemoryReducer | None:
    """The ranks' shared-memory reducer where they all run on one machine (rank 0 makes the segment, the others
    attach by the name it posts), else None. Every rank makes the same choice: where one cannot map the segment
    (a /dev/shm too small, say), none uses it."""
    store.set(f"local/{rank}", f"{SharedMemoryReducer.host()} {os.getpid()}")
    hosts, pids = zip(*(store.get(f"local/{r}").decode().split() for r in range(size)), strict=True)
    if not SharedMemoryReducer.usable(list(hosts)):
        return None
    timeout, pids = STEP_TIMEOUT.total_seconds(), [int(p) for p in pids]
    local = None
    try:
        if rank == 0:
            local = SharedMemoryReducer.create(size, pids, timeout)
        elif name := store.get("local/segment").decode():
            local = SharedMemoryReducer.attach(name, rank, size, pids, timeout)
    except OSError as exc:
        log.warning("ridge: tensor-parallel rank %d cannot map a shared-memory segment (%s); all-reduces go through "
                    "gloo", rank, exc)
    if rank == 0:
        store.set("local/segment", local.name if local is not None else "")
    store.set(f"local/ok/{rank}", "1" if local is not None else "0")
    if all(store.get(f"local/ok/{r}") == b"1" for r in range(size)):
        if rank == 0:
            local.track()
        return local
    if local is not None:
        local.close()
    return None


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: a token outside them looks up zeros, and the all-reduce gives every
    rank every token's row. `weight` stays the (padded) shard, which a tied output projection multiplies by."""

    def __init__(self, weight: torch.Tensor, first: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first, self.stop, self.group = first, min(first + weight.shape[0], vocab_size), group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.first) | (input_ids >= self.stop)
        rows = F.embedding((input_ids - self.first).masked_fill_(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        self.group.all_reduce_(rows)
        return rows


class GatheredLogits(nn.Module):
    """The output projection over this rank's rows of the vocabulary; the ranks' logits gathered on rank 0 (the
    one that samples), cut back to the vocabulary from the last shard's padding. Other ranks return their own."""

    def __init__(self, projection: nn.Module, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.projection, self.vocab_size, self.group = projection, vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.projection(hidden)
        pieces = self.group.gather_on_first(local)
        return torch.cat(pieces, dim=-1)[..., : self.vocab_size] if pieces else local


def install_collectives(model: nn.Module, plan: ShardPlan, group: TPGroup) -> None:
    """Give a sharded model (shard_model, then its linears placed) the collectives that make each rank's partial
    results whole: the layers' all-reduces, the vocabulary-parallel embedding and the gathered logits."""
    for layer in model.layers:
        layer.all_reduce = group.all_reduce_
        if getattr(layer.ssm, "shared_group", None) is not None:  # Mamba-2's (a gated DeltaNet norms per head)
            layer.ssm.all_reduce = group.all_reduce_  # its norm's squares, a group split between ranks
        if getattr(layer.mlp, "reduces_its_output", False):  # Gemma 4's experts beside its MLP: each branch
            layer.mlp.all_reduce = group.all_reduce_
        if getattr(layer.attn, "sharded_norm", None) is not None:
            layer.attn.sharded_norm.all_reduce = group.all_reduce_  # q's and k's squares over all heads
    table = model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(table.data, plan.rank * plan.vocab_shard, plan.cfg.vocab_size, group)
    if getattr(model, "embed_per_layer", None) is not None:  # Gemma 4's per-layer table, cut as the embedding
        model.embed_per_layer = VocabParallelEmbedding(model.embed_per_layer.weight.data, plan.rank * plan.vocab_shard,
                                                       plan.cfg.vocab_size, group)
    if model.output_projection is None:  # torch's own nn.Linear was the pick: the (tied or own) weight as it is
        head = nn.Linear(table.shape[1], table.shape[0], bias=False)
        head.weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.output_projection = head
    model.output_projection = GatheredLogits(model.output_projection, plan.cfg.vocab_size, group)
