"""The proxy's contracts: its settings, where it forwards to, what it reports, who hears it.

:class:`ProxyConfig` says how :class:`router.front.proxy.WorkerProxy` forwards (timeouts,
attempts, limits, the keys sent), :class:`ProxyTarget` where to, :class:`ProxyResult` and
:class:`WorkersUnavailableError` what came of it; an :class:`AttemptObserver` hears the life
of each attempt and a :class:`ResponseRewriter` rewrites the answers. No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from events.auth import SentKey
from events.identity import WorkerId
from router.errors import RouterError

__all__ = [
    "AttemptObserver",
    "AttemptOutcome",
    "ProxyConfig",
    "ProxyResult",
    "ProxyTarget",
    "ResponseRewriter",
    "WorkersUnavailableError",
]


AttemptOutcome = Literal["ok", "failed", "aborted"]
"""How an attempt ended: answered (below 500), failed (the worker's fault), aborted (the
client left)."""


class WorkersUnavailableError(RouterError):
    """No worker's answer can go to the client.

    Attributes:
        failures: One ``"worker: reason"`` line per failed attempt.
        timed_out: The request ran out of its total time.
    """

    def __init__(self, failures: Sequence[str], *, timed_out: bool = False) -> None:
        super().__init__("no worker could serve the request: " + "; ".join(failures))
        self.failures = list(failures)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """How requests are forwarded.

    Attributes:
        connect_timeout_s: Longest wait for a TCP connection to a worker, and for its
            answer to a ``GET /health`` liveness probe.
        first_byte_timeout_s: Silence from a worker (before its first byte, or mid-answer)
            after which it is probed; no answer to the probe gives it up.
        total_timeout_s: Longest time one request may take, every attempt included.
        max_attempts: Workers tried per request, the chosen one included.
        max_response_bytes: Largest buffered (non-streaming) response accepted.
        forward_authorization: Pass the client's ``Authorization`` header on to the
            worker; off by default, as it holds the client's credentials (the router's
            own key, when it has one) and any worker may be a stranger's.
        worker_key: The workers' API key, sent as ``Authorization`` with every forwarded
            request (in place of a forwarded client's).
    """

    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 5.0
    total_timeout_s: float = 600.0
    max_attempts: int = 2
    max_response_bytes: int = 64 * 1024 * 1024
    forward_authorization: bool = False
    worker_key: SentKey | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise RouterError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise RouterError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    """A worker to forward to: its id and the base URL of its HTTP API."""

    worker_id: WorkerId
    url: str


@dataclass(slots=True)
class ProxyResult:
    """What happened to a forwarded request.

    Attributes:
        worker_id: The worker whose answer went back to the client.
        status: Its HTTP status.
        num_attempts: Workers tried, the successful one included.
        usage: The ``usage`` object of its completion (last stream chunk or body), if any.
        model: The ``model`` its completion names (where ``usage`` was found), if any.
        failures: ``"worker: reason"`` for each failed attempt.
        client_aborted: The client left before the whole answer reached it.
    """

    worker_id: WorkerId
    status: int
    num_attempts: int
    usage: dict[str, object] | None = None
    failures: list[str] = field(default_factory=list)
    client_aborted: bool = False
    model: str | None = None


class AttemptObserver(Protocol):
    """Hears the life of each attempt (used for load accounting)."""

    async def attempt_started(self, target: ProxyTarget) -> None:
        """A request is being sent to ``target``."""
        ...

    async def first_byte(self, target: ProxyTarget) -> None:
        """``target`` started answering (prefill done for streams; all done otherwise)."""
        ...

    async def attempt_ended(self, target: ProxyTarget, outcome: AttemptOutcome) -> None:
        """The attempt on ``target`` is over."""
        ...


class ResponseRewriter(Protocol):
    """Rewrites a worker's answer before it goes to the client (e.g. hides what the router
    asked for its own accounting)."""

    def rewrite_body(self, body: bytes) -> bytes:
        """A buffered JSON body."""
        ...

    def rewrite_event(self, data: bytes) -> bytes | None:
        """The payload of one ``data:`` line of a stream (``[DONE]`` included); ``None``
        drops the event."""
        ...
