"""How the server keeps its engine core alive (Supervision), what it reports of it (Health), and the
errors a request meets when the engine cannot serve it."""

from __future__ import annotations

from dataclasses import dataclass


class EngineDead(RuntimeError):
    """The engine core stopped (an error, a killed or stuck process); the request was not completed."""


class EngineRestarting(EngineDead):
    """The engine core is being restarted; new requests may be retried in about `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailed(RuntimeError):
    """The engine raised while running a step of this request; the request ended, the engine serves on."""


class QueueFull(RuntimeError):
    """More requests (or more work) are waiting than the server admits (--max-waiting, --max-queued-tokens)."""


class ShuttingDown(RuntimeError):
    """The server is draining and accepts no new requests."""


@dataclass(frozen=True)
class Supervision:
    """How the server keeps an engine core alive: a core that dies, or has work but reports no step for
    `stuck_after_s`, is killed and started again, at most `max_restarts` times in any `window_s`; past
    that the engine is dead for good and `on_give_up` is called (the server then exits non-zero, for its
    supervisor -- systemd, Kubernetes -- to act)."""

    max_restarts: int = 3
    window_s: float = 600.0
    stuck_after_s: float = 60.0


@dataclass(frozen=True)
class Health:
    """The engine's state as /health reports it: ok, starting, restarting, stuck or dead; while it
    (re)starts, the seconds after which a client may retry."""

    status: str
    message: str | None = None
    retry_after_s: int | None = None
