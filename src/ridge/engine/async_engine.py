"""AsyncEngine: the server's handle on an engine core running in its own process.

The core (engine_core.py) only schedules, runs the model and samples. This side tokenizes (in the
callers), detokenizes and finds stop strings (output_processor.py), and hands each request its
outputs as an async iterator. Commands go down one pipe; a reader thread takes the core's step
reports off it and delivers each request's output to its asyncio queue.

Two processes rather than two threads: with one interpreter lock, every HTTP chunk the server wrote
stalled the step loop between its tensor ops; measured, the server reached 63% of the offline
throughput that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from ridge.config import EngineConfig
from ridge.engine.engine import RequestLimits, RequestOutput
from ridge.engine.engine_core import (
    AbortRequest,
    AddRequest,
    EngineState,
    Failed,
    QueryState,
    Ready,
    Rejected,
    Shutdown,
    StepReport,
    run_engine_core,
)
from ridge.engine.output_processor import RequestTracker
from ridge.hub import resolve
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import RidgeTokenizer

log = logging.getLogger("ridge")


class EngineDead(RuntimeError):
    """The engine core stopped on an error; no request can be served any more."""


class QueueFull(RuntimeError):
    """More requests are waiting than the server admits (--max-waiting)."""


class ShuttingDown(RuntimeError):
    """The server is draining and accepts no new requests."""


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        max_waiting: int | None = None,
        on_step: Callable[[StepReport, list[RequestOutput]], None] | None = None,
        stuck_after_s: float = 60.0,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.max_waiting = max_waiting
        self.stuck_after_s = stuck_after_s
        self._on_step = on_step
        self._progress = progress
        # request id -> (its tracker, its event loop, its output queue); guarded by _lock, since callers
        # (the event loop) add and remove entries while the reader thread delivers to them
        self._requests: dict[str, tuple[RequestTracker, asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the event loop and the reader thread both send commands
        self._states: queue.SimpleQueue[EngineState] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.accepting = True
        self.last_progress = time.monotonic()
        self._stopping = False

    # ---- lifetime -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core process and wait until its model is loaded (its progress bar shows meanwhile)."""
        context = multiprocessing.get_context("spawn")  # fork would copy this process's threads and locks
        self._conn, core_end = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(self.config, core_end, self._progress),
                                        name="ridge-engine-core", daemon=True)
        self._process.start()
        core_end.close()
        self.tokenizer = RidgeTokenizer.from_path(resolve(self.config.model))  # while the core loads
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = Failed(f"the engine process exited with code {self._process.exitcode}")
        if isinstance(ready, Failed):
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start: {ready.message}")
        assert isinstance(ready, Ready), ready
        self.limits: RequestLimits = ready.limits
        self.num_blocks = ready.num_blocks
        self._reader = threading.Thread(target=self._read, name="ridge-engine-reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """Stop the core process (requests still running are not finished); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError, ValueError):
            self._send(Shutdown())
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._reader.join(timeout=5)
        self._conn.close()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # ---- admission ------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Sequences admitted that have no token yet: queued here, in the pipe, or in the core."""
        with self._lock:
            return sum(t.params.n for t, _, _ in self._requests.values() if not t.started)

    @property
    def healthy(self) -> bool:
        """False once the core has died, or when it has work but has not reported a step for a while."""
        if self.error is not None or not self._process.is_alive():
            return False
        return not self.num_unfinished or time.monotonic() - self.last_progress < self.stuck_after_s

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(prompt_ids, params)

    def check_admission(self, count: int) -> None:
        """Raise EngineDead, ShuttingDown or QueueFull if `count` more sequences cannot be taken now."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error}")
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting + count > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting; the limit (--max-waiting) is {self.max_waiting}")

    # ---- requests -------------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; the last has finished=True.

        Validation errors (ValueError) are raised here, before anything is queued. Leaving the iteration
        early (a client that disconnects) aborts the request, which frees its KV blocks within one step.
        """
        self.check_admission(params.n)
        self.validate(prompt_ids, params)
        tracker = RequestTracker(request_id, prompt_ids, params, self.tokenizer, time.perf_counter())
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            if not self._requests:  # the stuck clock starts with the work
                self.last_progress = time.monotonic()
            self._requests[request_id] = (tracker, asyncio.get_running_loop(), outputs)
        finished = False
        try:
            self._send(AddRequest(request_id, prompt_ids, params, tracker.arrival_time))
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._requests.pop(request_id, None)
            if not finished and self.error is None:
                with contextlib.suppress(OSError, ValueError):
                    self._send(AbortRequest(request_id))

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._requests)
        for request_id in ids:
            self._send(AbortRequest(request_id))

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; let running requests finish for up to grace_s, then abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_unfinished and time.monotonic() < deadline and self.error is None:
            await asyncio.sleep(0.05)
        if self.num_unfinished and self.error is None:
            log.warning("ridge: aborting %d requests still running after the %.0f s grace period",
                        self.num_unfinished, grace_s)
            self.abort_all()
            while self.num_unfinished and self.error is None:
                await asyncio.sleep(0.01)

    def state(self, timeout_s: float = 30.0) -> EngineState:
        """The core's KV pool and integrity check, as of now (blocking; for tests and diagnostics)."""
        self._send(QueryState())
        return self._states.get(timeout=timeout_s)

    # ---- the reader thread ----------------------------------------------------------------------
    def _send(self, command: object) -> None:
        with self._send_lock:
            self._conn.send(command)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._fail(f"the engine process exited with code {self._process.exitcode}")
                return
            if isinstance(message, StepReport):
                self._on_report(message)
            elif isinstance(message, EngineState):
                self._states.put(message)
            elif isinstance(message, Rejected):
                self._deliver(message.request_id, ValueError(message.message))
            elif isinstance(message, Failed):
                log.error("ridge: the engine stopped: %s", message.message)
                self._fail(message.message)
                return

    def _on_report(self, report: StepReport) -> None:
        self.last_progress = time.monotonic()
        outputs = []
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for delta in report.requests:
            with self._lock:
                entry = self._requests.get(delta.request_id)
            if entry is None:  # its caller left (and sent an abort); nothing to hand back
                continue
            tracker, loop, queue_ = entry
            if tracker.finished:  # finished here by a stop string; the engine's late tokens are dropped
                continue
            output, stopped = tracker.apply(delta)
            if stopped and not delta.finished:
                for index in ([None] if output.finished else stopped):
                    self._send(AbortRequest(delta.request_id, index))
            outputs.append(output)
            deliveries.setdefault(loop, []).append((queue_, output))
        for loop, items in deliveries.items():  # one wake-up of each event loop per step, not one per request
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_put_all, items)
        if self._on_step is not None:
            self._on_step(report, outputs)

    def _fail(self, message: str) -> None:
        self.error = EngineDead(message)
        with self._lock:
            ids = list(self._requests)
        for request_id in ids:
            self._deliver(request_id, EngineDead(f"the engine stopped: {message}"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            return
        _, loop, outputs = entry
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
            loop.call_soon_threadsafe(outputs.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)
