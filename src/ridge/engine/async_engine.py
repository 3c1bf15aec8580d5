"""AsyncEngine: an LLMEngine stepping in its own thread, fed and drained through queues, for the server.

The engine thread owns the LLMEngine: only it touches the scheduler, the KV pool and the model.
Requests and aborts cross over on a thread-safe command queue; each step's outputs go back to the
requests' asyncio queues through loop.call_soon_threadsafe. Tokenizing prompts and rendering chat
templates happen in the callers (the server's event loop), off the engine's critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ridge.engine.engine import LLMEngine, RequestOutput
from ridge.sampling_params import SamplingParams

log = logging.getLogger("ridge")


class EngineDead(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


class QueueFull(RuntimeError):
    """More requests are waiting than the server admits (--max-waiting)."""


class ShuttingDown(RuntimeError):
    """The server is draining and accepts no new requests."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        stuck_after_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.stuck_after_s = stuck_after_s
        self._on_step = on_step
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # request id -> (its event loop, its output queue); written by callers, read by the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._pending = 0  # requests queued but not yet handed to the engine (counted as waiting)
        self.error: BaseException | None = None
        self.accepting = True
        self.last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ridge-engine", daemon=True)

    # ---- the caller's side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died, or when it has work but has not stepped for a while."""
        if self.error is not None or not self._thread.is_alive():
            return False
        busy = self.num_unfinished > 0
        return not busy or time.monotonic() - self.last_progress < self.stuck_after_s

    def check_admission(self, count: int) -> None:
        """Raise EngineDead, ShuttingDown or QueueFull if `count` more sequences cannot be taken now."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting + count > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting; the limit (--max-waiting) is {self.max_waiting}")

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; the last has finished=True.

        Validation errors (ValueError) are raised here, before anything is queued. Leaving the iteration
        early (a client that disconnects) aborts the request, which frees its KV blocks within one step.
        """
        self.check_admission(1)
        self.engine.validate(prompt_ids, params)  # reads only the config and vocabulary: safe off-thread
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
            self._pending += 1
        self._send(_Add(request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; let running requests finish for up to grace_s, then abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_unfinished and time.monotonic() < deadline and self.error is None:
            await asyncio.sleep(0.05)
        if self.num_unfinished:
            log.warning("ridge: aborting %d requests still running after the %.0f s grace period",
                        self.num_unfinished, grace_s)
            self.abort_all()
            while self.num_unfinished and self._thread.is_alive():
                await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before reading commands: a command sent after this sets it again
                self._apply_commands()
                if not self.engine.has_unfinished:
                    self.last_progress = time.monotonic()
                    self._wake.wait(timeout=1.0)
                    continue
                outputs = self.engine.step()
                self.last_progress = time.monotonic()
                if self._on_step is not None:
                    self._on_step(self.engine, outputs)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # a bug or an out-of-memory: fail every request, report unhealthy
            log.exception("ridge: the engine thread stopped")
            self.error = exc
            with self._lock:
                ids = list(self._streams)
            for request_id in ids:
                self._deliver(request_id, EngineDead(f"the engine stopped: {exc!r}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                continue
            with self._lock:
                self._pending -= 1
                wanted = command.request_id in self._streams  # its caller may have left already
            if not wanted:
                continue
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.request_id)
            except ValueError as exc:
                self._deliver(command.request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:  # the caller left (and sent an abort); nothing to hand back
            return
        loop, outputs = target
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
            loop.call_soon_threadsafe(outputs.put_nowait, item)
