"""AsyncEngine: the server's handle on an engine core running in its own process.

The core (engine_core.py) only schedules, runs the model and samples. This side tokenizes (in the
callers), detokenizes and finds stop strings (output_processor.py), and hands each request its
outputs as an async iterator. Commands go down one pipe; a reader thread takes the core's step
reports off it and delivers each request's output to its asyncio queue. A supervisor thread restarts
a core that dies or stops stepping (Supervision); the requests it held end with EngineDead.

Two processes rather than two threads: with one interpreter lock, every HTTP chunk the server writes
stalls the step loop between its tensor ops (docs/notes/kernel-choices.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property

from ridge.config import EngineConfig
from ridge.engine.engine_core import (
    AbortRequest,
    AdapterReply,
    AddRequest,
    CoreProcess,
    EngineState,
    ExportPrefix,
    Failed,
    ImportPrefix,
    LoadAdapter,
    PrefixReply,
    QueryState,
    Rejected,
    Shutdown,
    StepFailed,
    StepReport,
    UnloadAdapter,
)
from ridge.engine.limits import RequestLimits
from ridge.engine.loading import ModelFile
from ridge.engine.output_processor import RequestTracker
from ridge.engine.outputs import OutputKind, RequestOutput
from ridge.engine.scheduler import check_priority
from ridge.engine.structured import GrammarCompiler
from ridge.engine.supervision import (
    EngineDead,
    EngineRestarting,
    Health,
    QueueFull,
    RequestFailed,
    ShuttingDown,
    Supervision,
)
from ridge.lora.request import LoRARequest
from ridge.multimodal.placement import ImagePrompt
from ridge.sampling_params import SamplingParams

log = logging.getLogger("ridge")


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        max_waiting: int | None = None,
        on_step: Callable[[StepReport, list[RequestOutput]], None] | None = None,
        supervision: Supervision | None = None,
        progress: bool = True,
        max_queued_tokens: int | None = None,
        on_give_up: Callable[[str], None] | None = None,
        grace_s: float = 30.0,
    ) -> None:
        self.config = config
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.supervision = supervision or Supervision()
        self.grace_s = grace_s
        self._on_step = on_step
        self._on_give_up = on_give_up
        self._progress = progress
        # request id -> its entry; guarded by _lock, since callers (the event loop) add and remove entries
        # while the reader thread delivers to them
        self._requests: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the event loop and the reader thread both send commands
        self._states: queue.SimpleQueue[EngineState] = queue.SimpleQueue()
        self._prefix_replies: queue.SimpleQueue[PrefixReply] = queue.SimpleQueue()
        self._transfer_lock = threading.Lock()
        self._adapter_replies: queue.SimpleQueue[AdapterReply] = queue.SimpleQueue()
        self._adapter_lock = threading.Lock()
        self._died = threading.Event()  # a reader saw its core die (or the supervisor found it stuck)
        self._restarts: collections.deque[float] = collections.deque()
        self.error: BaseException | None = None
        self._phase = "starting"  # ok, restarting, dead: the supervisor's view; health() is the public one
        self.accepting = True
        self.last_progress = time.monotonic()
        self.load_time_s = 0.0
        self._stopping = False

    # ---- lifetime -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core process and wait until its model is loaded (its progress bar shows meanwhile);
        then supervise it from a thread of its own."""
        self.tokenizer = ModelFile.open(self.config.model).tokenizer
        self._core = self._launch(0)
        self._phase = "ok"
        self._supervisor = threading.Thread(target=self._supervise, name="ridge-engine-supervisor", daemon=True)
        self._supervisor.start()

    def _launch(self, generation: int) -> CoreProcess:
        """A new core process, loaded and reporting Ready, with its reader thread running."""
        started = time.monotonic()
        core, ready = CoreProcess.launch(self.config, generation, self._progress, self.grace_s)
        self.load_time_s = time.monotonic() - started
        self.limits: RequestLimits = ready.limits
        self.num_blocks = ready.num_blocks
        self.labels = ready.labels
        self.images = ready.images
        threading.Thread(target=self._read, args=(core,), name="ridge-engine-reader", daemon=True).start()
        return core

    def stop(self) -> None:
        """Stop the core process (requests still running are not finished); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._died.set()  # wakes the supervisor, which sees _stopping and returns
        with contextlib.suppress(OSError, ValueError):
            self._send(Shutdown())
        self._core.stop()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def pid(self) -> int | None:
        return self._core.process.pid

    # ---- supervision ----------------------------------------------------------------------------
    @property
    def stuck(self) -> bool:
        """The core has work but has reported no step for stuck_after_s."""
        return bool(self.num_unfinished) and time.monotonic() - self.last_progress > self.supervision.stuck_after_s

    def _supervise(self) -> None:
        while not self._stopping:
            if not self._died.wait(timeout=0.5):
                if self._phase == "ok" and self.stuck:
                    log.error("ridge: the engine has reported no step for %.0f s with work to do; killing it",
                              time.monotonic() - self.last_progress)
                    self._core.process.kill()  # its reader sees the pipe close and reports the death
                continue
            if self._stopping:
                return
            self._died.clear()
            self._restart()

    def _restart(self) -> None:
        reason = str(self.error)
        old = self._core
        old.stop()  # its reader has seen the pipe close already
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.supervision.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.supervision.max_restarts:
            self._give_up(f"{reason}; {len(self._restarts)} restarts in the last "
                          f"{self.supervision.window_s:.0f} s already (--engine-restarts)")
            return
        self._restarts.append(now)
        self._phase = "restarting"
        log.warning("ridge: restarting the engine (%s)", reason)
        try:
            core = self._launch(old.generation + 1)
        except Exception as exc:  # noqa: BLE001 - whatever stops a load ends the supervision
            self._give_up(f"{reason}; the restart failed: {exc}")
            return
        self._core = core
        self.last_progress = time.monotonic()
        self.error = None
        self._phase = "ok"
        self._fail_generation(old.generation)  # any request that slipped into the old pipe as it died
        log.warning("ridge: the engine is back after %.1f s", self.load_time_s)

    def _give_up(self, message: str) -> None:
        self._phase = "dead"
        log.error("ridge: the engine is dead: %s", message)
        if self._on_give_up is not None:
            self._on_give_up(message)

    # ---- admission ------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Sequences admitted that have no token yet: queued here, in the pipe, or in the core."""
        with self._lock:
            return sum(e.tracker.params.n for e in self._requests.values() if not e.tracker.started)

    @property
    def queued_tokens(self) -> int:
        """The work admitted and not finished: prompt + n x max_tokens of every request in flight."""
        with self._lock:
            return sum(e.work for e in self._requests.values())

    def health(self) -> Health:
        """What the core is doing now; /health and admission both read it."""
        if self._phase == "dead":
            return Health("dead", f"the engine stopped: {self.error}")
        if self._phase == "starting":
            return Health("starting", "the engine is loading its model", max(1, math.ceil(self.load_time_s)))
        if self._phase == "restarting" or self.error is not None or not self._core.process.is_alive():
            # a core seen dying is restarted by the supervisor within half a second
            reason = self.error or f"the engine process exited with code {self._core.process.exitcode}"
            return Health("restarting", f"the engine is restarting ({reason})", max(1, math.ceil(self.load_time_s)))
        if self.stuck:
            return Health("stuck", f"the engine has reported no step for {time.monotonic() - self.last_progress:.0f} s")
        return Health("ok")

    def validate(self, prompt_ids: list[int], params: SamplingParams, embed: bool = False) -> None:
        self.limits.validate(prompt_ids, params, embed)
        if params.structured_outputs is not None:  # a bad grammar is the request's error, found here
            self.grammars.grammar(params.structured_outputs)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        return GrammarCompiler(self.tokenizer, self.limits.vocab_size)

    def check_admission(self, count: int, work: int = 0) -> None:
        """Raise EngineDead (or EngineRestarting), ShuttingDown or QueueFull if `count` more sequences
        carrying `work` tokens cannot be taken now."""
        health = self.health()
        if health.retry_after_s is not None:
            raise EngineRestarting(f"{health.message}; retry shortly", health.retry_after_s)
        if health.status != "ok":
            raise EngineDead(health.message)
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting + count > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting; the limit (--max-waiting) is {self.max_waiting}")
        if self.max_queued_tokens is not None and (queued := self.queued_tokens) + work > self.max_queued_tokens:
            raise QueueFull(f"{queued} tokens of work are queued and this request adds {work}; the limit "
                            f"(--max-queued-tokens) is {self.max_queued_tokens}")

    # ---- requests -------------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, kind: OutputKind = OutputKind.FINAL,
        lora_request: LoRARequest | None = None, priority: int = 0, embed: bool = False,
        images: ImagePrompt | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request: its whole output once it finishes (FINAL), or each step's news, the last
        with finished=True (DELTA); lora_request: the adapter it runs with (one of config.lora_modules');
        priority: under schedule_policy priority, lower goes first; embed: the prompt's embedding (output.embedding,
        on a pooling runner) rather than a generation; images: the prompt's images placed in it (self.images.place).

        Validation errors (ValueError) are raised here, before anything is queued. Leaving the iteration
        early (a client that disconnects) aborts the request, which frees its KV blocks within one step.
        A core that dies meanwhile raises EngineDead; a step that fails on this request, RequestFailed.
        """
        work = len(prompt_ids) + params.n * params.max_tokens
        self.check_admission(params.n, work)
        self.validate(prompt_ids, params, embed)
        check_priority(self.config.schedule_policy, priority)
        self.config.check_request_kind(embed)  # the engine's own refusal, before anything is queued
        tracker = RequestTracker(request_id, None, prompt_ids, params, self.tokenizer, kind)
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            if not self._requests:  # the stuck clock starts with the work
                self.last_progress = time.monotonic()
            core = self._core
            self._requests[request_id] = _Entry(tracker, asyncio.get_running_loop(), outputs, work, core.generation)
        finished = False
        try:
            try:
                command = AddRequest(request_id, prompt_ids, params, tracker.arrival_time, lora_request, priority,
                                     embed, images)
                self._send(command, core)
            except (OSError, ValueError) as exc:  # the core died as this request arrived
                raise EngineDead(f"the engine stopped: {exc}") from exc
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the core has forgotten it (failed step) or is gone: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._requests.pop(request_id, None)
            if not finished and self.error is None:
                with contextlib.suppress(OSError, ValueError):
                    self._send(AbortRequest(request_id), core)

    def abort_all(self) -> None:
        """Abort every request in flight (at shutdown); a request the core no longer holds needs none."""
        core = self._core
        with self._lock:
            ids = [i for i, e in self._requests.items() if e.generation == core.generation]
        with contextlib.suppress(OSError, ValueError):  # the core is gone: its requests are ended already
            for request_id in ids:
                self._send(AbortRequest(request_id), core)

    def transfer(self, command: ExportPrefix | ImportPrefix, timeout_s: float = 120.0) -> PrefixReply:
        """Export or import a cached prefix's blocks (blocking: call it from a thread; one at a time)."""
        with self._transfer_lock:
            try:
                self._send(command)
            except (OSError, ValueError) as exc:
                raise EngineDead(f"the engine stopped: {exc}") from exc
            return self._prefix_replies.get(timeout=timeout_s)

    def update_adapters(self, command: LoadAdapter | UnloadAdapter, timeout_s: float = 120.0) -> None:
        """Load or unload a LoRA adapter in the core (blocking: call it from a thread); ValueError naming what did
        not fit."""
        with self._adapter_lock:
            try:
                self._send(command)
            except (OSError, ValueError) as exc:
                raise EngineDead(f"the engine stopped: {exc}") from exc
            reply = self._adapter_replies.get(timeout=timeout_s)
        if reply.error is not None:
            raise ValueError(reply.error)

    def state(self, timeout_s: float = 30.0) -> EngineState:
        """The core's KV pool and integrity check, as of now (blocking; for tests and diagnostics)."""
        try:
            self._send(QueryState())
        except (OSError, ValueError) as exc:
            raise EngineDead(f"the engine stopped: {exc}") from exc
        return self._states.get(timeout=timeout_s)

    # ---- the reader thread ----------------------------------------------------------------------
    def _send(self, command: object, core: CoreProcess | None = None) -> None:
        """Send to the current core, or to `core` only if it is still the current one."""
        with self._send_lock:
            current = self._core
            if core is not None and core is not current:
                raise OSError("the engine was restarted since")
            current.conn.send(command)

    def _read(self, core: CoreProcess) -> None:
        while True:
            try:
                message = core.conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._fail(f"the engine process exited with code {core.process.exitcode}")
                return
            if isinstance(message, StepReport):
                self._on_report(message, core)
            elif isinstance(message, EngineState):
                self._states.put(message)
            elif isinstance(message, PrefixReply):
                self._prefix_replies.put(message)
            elif isinstance(message, AdapterReply):
                self._adapter_replies.put(message)
            elif isinstance(message, Rejected):
                self._deliver(message.request_id, ValueError(message.message))
            elif isinstance(message, StepFailed):
                log.error("ridge: a step failed, ending %d requests: %s", len(message.request_ids), message.message)
                for request_id in message.request_ids:
                    self._deliver(request_id, RequestFailed(f"the engine failed on this request: {message.message}"))
            elif isinstance(message, Failed):
                log.error("ridge: the engine stopped: %s", message.message)
                self._fail(message.message)
                return

    def _on_report(self, report: StepReport, core: CoreProcess) -> None:
        self.last_progress = time.monotonic()
        finished = []
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for delta in report.requests:
            with self._lock:
                entry = self._requests.get(delta.request_id)
            if entry is None:  # its caller left (and sent an abort); nothing to hand back
                continue
            tracker = entry.tracker
            if tracker.finished:  # finished here by a stop string; the engine's late tokens are dropped
                continue
            output, stopped = tracker.apply(delta)
            if stopped and not delta.finished:
                with contextlib.suppress(OSError, ValueError):  # the core died after sending this report
                    for index in ([None] if tracker.finished else stopped):
                        self._send(AbortRequest(delta.request_id, index), core)
            if output is not None:
                deliveries.setdefault(entry.loop, []).append((entry.outputs, output))
            if tracker.finished:
                finished.append(tracker.whole_output())
        for loop, items in deliveries.items():  # one wake-up of each event loop per step, not one per request
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_put_all, items)
        if self._on_step is not None:
            self._on_step(report, finished)

    def _fail(self, message: str) -> None:
        """The core is gone: every request in flight ends with EngineDead, and the supervisor acts."""
        self.error = EngineDead(message)
        with self._lock:
            ids = list(self._requests)
        for request_id in ids:
            self._deliver(request_id, EngineDead(f"the engine stopped: {message}; this request was not completed"))
        self._died.set()

    def _fail_generation(self, generation: int) -> None:
        with self._lock:
            ids = [i for i, e in self._requests.items() if e.generation <= generation]
        for request_id in ids:
            self._deliver(request_id, EngineDead("the engine restarted; this request was not completed"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            return
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
            entry.loop.call_soon_threadsafe(entry.outputs.put_nowait, item)


@dataclass
class _Entry:
    """A request in flight, as the server's side holds it."""

    tracker: RequestTracker
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    work: int  # prompt + n x max_tokens: what it may still cost the engine
    generation: int  # the core incarnation it was sent to


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)
