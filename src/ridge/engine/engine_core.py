"""The engine core: an LLMEngine stepping in a process of its own, driven over a pipe.

The server's process (tokenizer, HTTP, detokenization, stop strings) and the step loop then never
wait on one interpreter lock: the loop only schedules, runs the model and samples. Commands arrive
as small dataclasses; each step answers with one StepReport carrying only what that step added to
each sample (token ids, logprobs, finish), never the cumulative outputs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ridge.config import EngineConfig
from ridge.engine import kv_transfer, processes
from ridge.engine.engine import LLMEngine
from ridge.engine.kv_transfer import PrefixBlocks
from ridge.engine.limits import RequestLimits
from ridge.engine.native_memory import HeapTrimmer, bound_onednn_caches
from ridge.engine.outputs import AdapterUse, RequestDelta, StepError, StepStats
from ridge.lora.request import LoRARequest
from ridge.multimodal.placement import ImagePrompt, ImageReader
from ridge.sampling_params import SamplingParams


# ---- commands: server -> core --------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None
    priority: int = 0
    embed: bool = False
    images: ImagePrompt | None = None  # the prompt's images placed in it (prompt_ids are its token_ids)


@dataclass
class AbortRequest:
    request_id: str
    index: int | None = None  # one sample only (it met a stop string the server found), or all of them


@dataclass
class QueryState:
    """Asks for an EngineState (tests, and /health's idea of the KV pool)."""


@dataclass
class ExportPrefix:
    """Asks for the cached blocks of a prompt's prefix (disaggregated prefill): answered by a PrefixReply."""

    token_ids: list[int]
    salt: str | None


@dataclass
class ImportPrefix:
    """Blocks of a prefix another engine computed, for this one's prefix cache: answered by a PrefixReply."""

    blocks: PrefixBlocks


@dataclass
class LoadAdapter:
    """Load a LoRA adapter now (a server's runtime loading): answered by an AdapterReply."""

    request: LoRARequest


@dataclass
class UnloadAdapter:
    """Unload a LoRA adapter no request uses: answered by an AdapterReply."""

    name: str


@dataclass
class Shutdown:
    pass


# ---- answers: core -> server ---------------------------------------------------------------------
@dataclass
class Ready:
    limits: RequestLimits
    num_blocks: int
    block_size: int
    labels: tuple[str, ...] = ()  # a classifier's (LLMEngine.labels)
    images: ImageReader | None = None  # a vision model's (LLMEngine.images): the server prepares requests' images


@dataclass
class Failed:
    """The core stopped on an error (while loading or stepping); it exits after sending this."""

    message: str


@dataclass
class StepFailed:
    """A step raised: these requests ended without an output (their blocks are free); the core steps on."""

    request_ids: list[str]
    message: str


@dataclass
class Rejected:
    """A request the engine refused: its id already in use (the server checked the limits before sending it)."""

    request_id: str
    message: str


@dataclass
class StepReport:
    requests: list[RequestDelta]
    stats: StepStats
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    adapters: AdapterUse | None = None
    time: float = field(default_factory=time.perf_counter)


@dataclass
class PrefixReply:
    blocks: PrefixBlocks | None = None  # an export's
    adopted: int = 0  # an import's
    error: str | None = None  # why it could not be done (a ValueError's message)


@dataclass
class AdapterReply:
    error: str | None = None  # why it could not be done (a ValueError's message)


@dataclass
class EngineState:
    idle: bool  # no request in the engine, and no aborted one still to report
    num_free_blocks: int
    num_blocks: int
    integrity_error: str | None  # the KV accounting check's message, None when it holds


@dataclass
class CoreProcess:
    """One incarnation of the engine core process and the server's end of its pipe."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    generation: int

    @classmethod
    def launch(cls, config: EngineConfig, generation: int, progress: bool, grace_s: float) -> tuple[CoreProcess, Ready]:
        """A new core process, its model loaded (RuntimeError naming why it failed to start)."""
        conn, core_end = multiprocessing.Pipe()
        process = processes.start(run_engine_core, (config, core_end, progress, grace_s), "ridge-engine-core")
        core_end.close()
        try:
            ready = conn.recv()
        except EOFError:
            ready = Failed(f"the engine process exited with code {process.exitcode}")
        if isinstance(ready, Failed):
            process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start: {ready.message}")
        assert isinstance(ready, Ready), ready
        return cls(process, conn, generation), ready

    def stop(self) -> None:
        """Wait for the process to end after a Shutdown; kill it if busy inside a long step, or wedged."""
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


def run_engine_core(config: EngineConfig, conn: Connection, progress: bool, grace_s: float = 30.0) -> None:
    """The core process's main: load, report Ready (or Failed), then serve commands until Shutdown or
    until the server's end of the pipe closes."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the server drains its requests
    # for grace_s and then sends Shutdown. A SIGTERM still ends this process a little after that, so that
    # a core stuck inside a step cannot outlive its server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _exit_after(grace_s + 5.0))
    bound_onednn_caches()
    try:
        engine = LLMEngine(config, progress=progress)
    except Exception as exc:  # a bad model name, too little KV memory: the server reports it and exits
        conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(Ready(engine.limits, engine.kv.num_blocks, engine.kv.block_size, engine.labels, engine.images))
    try:
        _serve(engine, conn)
    except (EOFError, OSError):  # the server is gone: nothing left to serve
        return
    except BaseException as exc:
        conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        engine.close()


def _serve(engine: LLMEngine, conn: Connection) -> None:
    heap = HeapTrimmer()
    while True:
        # Block while idle; while busy, take whatever arrived since the last step and step again.
        while conn.poll(None if not engine.has_unfinished else 0):
            command = conn.recv()
            if isinstance(command, Shutdown):
                return
            _apply(engine, conn, command)
        if not engine.has_unfinished:
            continue
        try:
            deltas = engine.step()
        except StepError as exc:
            traceback.print_exc()
            conn.send(StepFailed(exc.request_ids, exc.message))
            engine.check_integrity()  # if the failed step broke the KV accounting, the server restarts the core
            continue
        conn.send(StepReport(deltas, engine.last_step, len(engine.scheduler.running), len(engine.scheduler.waiting),
                             engine.kv.num_free, engine.kv.num_blocks, engine.adapter_use()))
        heap.after_step(idle=not engine.has_unfinished)


def _exit_after(delay_s: float) -> None:
    timer = threading.Timer(delay_s, os._exit, (0,))
    timer.daemon = True
    timer.start()


def _apply(engine: LLMEngine, conn: Connection,
           command: AddRequest | AbortRequest | QueryState | ExportPrefix | ImportPrefix | LoadAdapter | UnloadAdapter
           ) -> None:
    if isinstance(command, AddRequest):
        try:
            # the server checked the request against the limits this engine sent it (Ready.limits)
            engine.add_request(command.prompt_ids, command.params, command.request_id, command.arrival_time,
                               validated=True, lora_request=command.lora_request, priority=command.priority,
                               embed=command.embed, images=command.images)
        except ValueError as exc:
            conn.send(Rejected(command.request_id, str(exc)))
    elif isinstance(command, AbortRequest):
        engine.abort(command.request_id, command.index)
    elif isinstance(command, ExportPrefix | ImportPrefix):
        try:
            kv_transfer.check_transferable(engine)
            if isinstance(command, ExportPrefix):
                reply = PrefixReply(blocks=kv_transfer.export_prefix(engine, command.token_ids, command.salt))
            else:
                reply = PrefixReply(adopted=kv_transfer.import_prefix(engine, command.blocks))
        except ValueError as exc:
            reply = PrefixReply(error=str(exc))
        conn.send(reply)
    elif isinstance(command, LoadAdapter | UnloadAdapter):
        try:
            if isinstance(command, LoadAdapter):
                engine.load_adapter(command.request)
            else:
                engine.unload_adapter(command.name)
            conn.send(AdapterReply())
        except ValueError as exc:
            conn.send(AdapterReply(str(exc)))
    elif isinstance(command, QueryState):
        try:
            engine.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "the KV accounting check failed"
        conn.send(EngineState(not engine.has_unfinished, engine.kv.num_free, engine.kv.num_blocks, error))
    else:
        raise TypeError(f"unknown engine command {command!r}")
