"""Tensor parallelism's processes: rank 0 is the engine, every other rank runs what rank 0 tells it.

Rank 0 schedules, samples and keeps the KV accounting, as vLLM's executor does; each step, it broadcasts the
step's flat inputs (ModelRunner.describe) and then runs them itself, while every other rank runs the same inputs
on its shard of the weights and of the KV cache (cluster/shards.py): the layers' all-reduces meet in the middle,
and the logits gather on rank 0 (cluster/collectives.py). Each rank holds the same number of KV blocks (rank 0
counts them, for the rank with the most KV heads), so rank 0's block tables index every rank's cache.

Ridge starts ranks 1..N-1 itself, as processes on this machine (`serve`, forked from engine/processes.py's fork
server), or torchrun starts every rank (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): then rank 0 is the one that
serves, and the others run `serve` from the command line (cli.py). A rank that exits
breaks the group: the others' next collective fails, and their engine reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.process
import multiprocessing.util
import os
import socket
import traceback
from dataclasses import dataclass

import torch

from ridge.cluster.collectives import TPGroup, install_collectives
from ridge.cluster.shards import ShardPlan, cut_heads
from ridge.config import EngineConfig
from ridge.engine import processes, prompt_logprobs
from ridge.engine.runner import ModelRunner, StepInputs, StepLogits
from ridge.engine.scheduler import ScheduledStep
from ridge.lora.request import LoRARequest

log = logging.getLogger("ridge")


# ---- rank 0 -> the other ranks ---------------------------------------------------------------------
@dataclass
class Build:
    """Make the model runner: the pool's size, as rank 0 counted it."""

    num_blocks: int
    num_state_slots: int
    max_model_len: int
    num_snapshots: int = 0
    pooling: str | None = None  # a pooling runner's (the engine's pooling_type for the model)


@dataclass
class RunStep:
    inputs: StepInputs  # without the sequences (samplers, scored), which only rank 0 holds
    prompt_rows: list[int]  # each scored sequence's row count: rank 0 projects them in prompt_logprobs.slices


@dataclass
class Score:
    token_ids: list[int]
    tables: list[list[int]]
    state_slot: int | None
    adapter: int | None = None


@dataclass
class AddAdapter:
    """Load a LoRA adapter rank 0 has loaded (so it reads and fits): each rank keeps its part, at the same index."""

    request: LoRARequest


@dataclass
class DropAdapter:
    """Unload a LoRA adapter rank 0 has unloaded."""

    name: str


@dataclass
class TimeAllReduce:
    """Time all-reduces of each size in float32 values (`ridge bench tp`'s link)."""

    sizes: list[int]
    repeats: int


@dataclass
class ReadBlocks:
    """Each rank's copy of these blocks of its cache, gathered on rank 0 (engine/kv_transfer.py's export)."""

    blocks: torch.Tensor


@dataclass
class CheckBlocks:
    """Whether each rank's cache takes blocks of its (shape, dtype)s, before rank 0 places any."""

    shapes: list[list[tuple[tuple[int, ...], torch.dtype]]]  # by rank


@dataclass
class WriteBlocks:
    """Another engine's whole blocks (every KV head): each rank writes its part, as `shards` cut them, into these
    blocks of its cache."""

    blocks: torch.Tensor
    data: list[torch.Tensor]
    shards: list[range] | None  # by rank (None: every rank takes them whole)

    def part(self, rank: int) -> list[torch.Tensor]:
        return cut_heads(self.data, self.shards, rank + 1)[rank]


@dataclass
class Stop:
    pass


def torchrun_rank() -> int | None:
    """This process's rank where torchrun (or a launcher like it) started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


@dataclass
class Ranks:
    """The group met, before any rank loads its shard: ranks load side by side, then rank 0 starts them running."""

    group: TPGroup
    workers: list[multiprocessing.process.BaseProcess]  # the ranks ridge started (none under torchrun)

    @classmethod
    def meet(cls, config: EngineConfig) -> Ranks:
        """Start (or, under torchrun, meet) the other ranks; they load their shards while this one loads its own.
        RuntimeError naming a rank that did not come."""
        url, workers = _launch(config)
        try:
            group = TPGroup.join(url, *((0, config.tensor_parallel_size) if workers else ()))
        except Exception as exc:
            _end(workers, kill=True)
            exited = [f"rank {i + 1} exited with code {w.exitcode}" for i, w in enumerate(workers)
                      if w.exitcode is not None]
            raise RuntimeError(f"tensor_parallel_size: the ranks did not meet at {url} "
                               f"({'; '.join(exited) or exc})") from exc
        ranks = cls(group, workers)
        if group.size != config.tensor_parallel_size:
            ranks.abort()
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size}, but the launcher's WORLD_SIZE is "
                             f"{group.size}")
        return ranks

    def abort(self) -> None:
        """Rank 0 could not start: the others stop (those loading still finish their load first)."""
        _stop_ranks(self.group, self.workers)

    def start(self, plan: ShardPlan, local: ModelRunner, build: Build) -> TensorParallelRunner:
        """Give rank 0's model its collectives; have every rank build its runner for `build`. RuntimeError naming a
        rank that failed to load (the caller aborts the others, as after any failure of its own)."""
        install_collectives(local.model, plan, self.group)
        self.group.broadcast_command(build)
        failed = [rank for rank, ok in enumerate(self.group.all_ok(True)) if not ok]
        if failed:
            raise RuntimeError(f"tensor_parallel_size: rank {failed[0]} failed to load its shard (its error is above)")
        log.info("ridge: tensor parallel over %d ranks (gloo)", self.group.size)
        return TensorParallelRunner(local, self.group, self.workers)


class TensorParallelRunner:
    """Rank 0's model runner: each step broadcast to the other ranks, then run here on rank 0's shard."""

    def __init__(self, local: ModelRunner, group: TPGroup, workers: list[multiprocessing.process.BaseProcess]) -> None:
        self.local, self.group, self.workers = local, group, workers
        self.broken: str | None = None
        # at close(), when the engine is collected, or when the interpreter exits (before processes.py kills what
        # is left: a rank asked to stop exits cleanly)
        self._finalizer = multiprocessing.util.Finalize(self, _stop_ranks, (group, workers),
                                                        exitpriority=processes.EXIT_PRIORITY + 1)

    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def backend(self):  # noqa: ANN201 - the local runner's AttentionBackend
        return self.local.backend

    def execute(self, step: ScheduledStep) -> StepLogits:
        inputs = self.local.describe(step)
        shared = dataclasses.replace(inputs, samplers=[], scored=[])
        return self._together(RunStep(shared, [r.count for r in inputs.scored]), self.local.run, inputs)

    def score(self, token_ids: list[int], tables: list[list[int]], state_slot: int | None = None,
              adapter: int | None = None) -> torch.Tensor:
        return self._together(Score(token_ids, tables, state_slot, adapter), self.local.score, token_ids, tables,
                              state_slot, adapter)

    def load_adapter(self, request: LoRARequest) -> int:
        """Load on rank 0 first (a ValueError leaves the group as it was), then on every other rank."""
        index = self.local.load_adapter(request)
        self._together(AddAdapter(request), lambda: None)
        return index

    def unload_adapter(self, name: str, in_use: set[int]) -> None:
        self.local.unload_adapter(name, in_use)
        self._together(DropAdapter(name), lambda: None)

    def time_all_reduce(self, sizes: list[int], repeats: int = 50) -> list[float]:
        """Median seconds of an all-reduce of each size (float32 values) over the group."""
        return self._together(TimeAllReduce(sizes, repeats), lambda: [self.group.time_all_reduce(n, repeats)
                                                                      for n in sizes])

    def read_blocks(self, blocks: torch.Tensor) -> list[list[torch.Tensor]]:
        """Every rank's copy of these blocks (AttentionBackend.read_blocks), by rank."""
        return self._together(ReadBlocks(blocks),
                              lambda: self.group.gather_objects(self.local.backend.read_blocks(blocks)))

    def takes_blocks(self, shapes: list[list[tuple[tuple[int, ...], torch.dtype]]]) -> bool:
        """Whether every rank's cache takes its blocks' (shape, dtype)s (one list a rank, as many as ranks)."""
        if len(shapes) != self.group.size:
            return False
        return self._together(CheckBlocks(shapes),
                              lambda: all(self.group.all_ok(self.local.backend.takes_blocks(shapes[0]))))

    def write_blocks(self, blocks: torch.Tensor, data: list[torch.Tensor], shards: list[range] | None) -> None:
        """Whole blocks, broadcast once; each rank writes its part (WriteBlocks)."""
        command = WriteBlocks(blocks, data, shards)
        self._together(command, lambda: self.local.backend.write_blocks(blocks, command.part(0)))

    def _together(self, command: RunStep | Score | TimeAllReduce | ReadBlocks | CheckBlocks | WriteBlocks | AddAdapter
                  | DropAdapter, run, *args):  # noqa: ANN001, ANN202 - the local runner's call
        """Broadcast the command, then run it here. A rank that failed mid-step leaves the group's collectives out
        of step with each other: the group is broken from then on, and says so."""
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group broke earlier ({self.broken}); restart the engine")
        try:
            self.group.broadcast_command(command)
            if isinstance(command, RunStep):
                self.local.prepare_backend(command.inputs.meta)
            return run(*args)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise

    def close(self) -> None:
        """Stop the other ranks (torchrun's end their `serve`)."""
        if self.broken is not None and self._finalizer.still_active():  # no command reaches a broken group
            self._finalizer.cancel()
            _end(self.workers)
            self.group.close()
        self._finalizer()
        self.broken = "closed"


def _stop_ranks(group: TPGroup, workers: list[multiprocessing.process.BaseProcess]) -> None:
    with contextlib.suppress(Exception):  # a rank already gone: nothing left to stop there
        group.broadcast_command(Stop())
    _end(workers)
    group.close()


def _end(workers: list[multiprocessing.process.BaseProcess], kill: bool = False) -> None:
    """Wait for the ranks ridge started to exit (a load in progress finishes first), or kill them."""
    for worker in workers:
        worker.join(timeout=0 if kill else 300)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _launch(config: EngineConfig) -> tuple[str, list[multiprocessing.process.BaseProcess]]:
    """The rendezvous URL, and ranks 1..N-1 started as processes here (none where torchrun started them)."""
    rank = torchrun_rank()
    if rank is not None:
        if rank != 0:
            raise ValueError(f"tensor_parallel_size: the engine runs on rank 0; rank {rank} runs "
                             "ridge.engine.tensor_parallel.serve instead")
        return "env://", []
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    workers = [processes.start(serve, (config, rank, url), f"ridge-rank-{rank}")
               for rank in range(1, config.tensor_parallel_size)]
    return url, workers


# ---- ranks 1..N-1 -----------------------------------------------------------------------------------
def serve(config: EngineConfig, rank: int | None = None, url: str = "env://") -> None:
    """Rank `rank`'s life (None: torchrun's RANK): meet the group, load this rank's shard (side by side with rank 0
    where each rank reads only its part of the file, else once rank 0 has loaded and met the group), build the
    runner rank 0 sizes, then run what rank 0 broadcasts until it says Stop."""
    torch.set_num_threads(config.threads_per_process())
    torch.manual_seed(config.seed)
    group = TPGroup.join(url, *((rank, config.tensor_parallel_size) if rank is not None else ()))
    try:
        _serve(config, group)
    finally:
        group.close()


def _serve(config: EngineConfig, group: TPGroup) -> None:
    from ridge.engine.engine import load_adapters
    from ridge.engine.loading import ModelFile, load_weights, shard_plan
    from ridge.kernels import cpu_ops

    runner, kernels, loaded, adapters = None, None, None, None
    try:
        kernels = cpu_ops.load() if config.cpu_kernels and config.device == "cpu" else None
        model = ModelFile.open(config.model, config.mmproj)
        plan = shard_plan(config, model, group.rank)
        loaded = load_weights(model, config, kernels, progress=False, plan=plan)
        install_collectives(loaded.model, plan, group)
        adapters = load_adapters(config, loaded, plan) if config.enable_lora else None
    except Exception:  # noqa: BLE001 - reported to rank 0 below, printed here
        traceback.print_exc()
        loaded = None
    build = group.broadcast_command()
    if isinstance(build, Stop):
        return
    if loaded is not None:
        try:
            runner = ModelRunner.for_engine(config, loaded.model, kernels, build.num_blocks, build.max_model_len,
                                            build.num_state_slots, build.num_snapshots, adapters, build.pooling)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if not all(group.all_ok(runner is not None)):
        return
    while True:
        command = group.broadcast_command()
        if isinstance(command, Stop):
            return
        if isinstance(command, Score):
            runner.score(command.token_ids, command.tables, command.state_slot, command.adapter)
            continue
        if isinstance(command, AddAdapter):  # rank 0 read it: the same file fits here too
            runner.load_adapter(command.request)
            continue
        if isinstance(command, DropAdapter):  # rank 0 checked that no request uses it
            runner.unload_adapter(command.name, set())
            continue
        if isinstance(command, TimeAllReduce):
            for n in command.sizes:
                group.time_all_reduce(n, command.repeats)
            continue
        if isinstance(command, ReadBlocks):
            group.gather_objects(runner.backend.read_blocks(command.blocks))
            continue
        if isinstance(command, CheckBlocks):
            group.all_ok(runner.backend.takes_blocks(command.shapes[group.rank]))
            continue
        if isinstance(command, WriteBlocks):
            runner.backend.write_blocks(command.blocks, command.part(group.rank))
            continue
        runner.prepare_backend(command.inputs.meta)
        out = runner.run(command.inputs)
        offset = 0
        for count in command.prompt_rows:  # the projections rank 0 makes of the prompt rows, in its order
            for begin, n in prompt_logprobs.slices(count):
                runner.model.compute_logits(out.prompt_hidden[offset + begin: offset + begin + n])
            offset += count
