"""Per-worker circuit breakers: a worker that keeps failing is skipped for a while, then tried once.

Each worker's circuit is in one of three states:

* ``closed``: routable. Failures (connect errors, timeouts, 5xx answers) are counted;
  ``failure_threshold`` in a row open it, and so does a single failure that shows the
  worker cannot be reached at all (connection refused, connect timeout, silent and not
  answering ``GET /health``): new requests should avoid it at once, not after several more
  of them have waited on it.
* ``open``: skipped by new routing decisions for ``cooldown_s``.
* ``half_open``: the cooldown is over; one trial request is let through (the others keep
  avoiding the worker). Its success closes the circuit, its failure opens it again.

A success (any answer that is not a 5xx) closes the circuit and resets the count. An
attempt that ended without a verdict (the client left) only frees the trial slot.

Invariants: at most one trial is in flight per half-open worker; a worker never seen is
closed; state changes only through :meth:`CircuitBreakers.admit`, :meth:`succeeded`,
:meth:`failed`, :meth:`released` and :meth:`forget`, and the passage of time.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from events.identity import WorkerId
from router.errors import RouterError

__all__ = ["BreakerConfig", "CircuitBreakers", "CircuitState", "CircuitView"]


class CircuitState(str, enum.Enum):
    """A worker's circuit state (its value is what ``/v1/workers`` shows)."""

    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a worker's circuit opens and for how long.

    Attributes:
        failure_threshold: Consecutive failures that open a closed circuit.
        cooldown_s: How long an open circuit keeps the worker out of routing before one
            trial request is let through.
    """

    failure_threshold: int = 3
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise RouterError(
                f"circuit failure threshold must be >= 1, got {self.failure_threshold}"
            )
        if not self.cooldown_s > 0:
            raise RouterError(f"circuit cooldown must be > 0 s, got {self.cooldown_s}")


@dataclass(frozen=True, slots=True)
class CircuitView:
    """A worker's circuit as reported (``GET /v1/workers``, ``/ready``).

    Attributes:
        state: Its state now.
        consecutive_failures: Failures since the last success.
        retry_in_s: While open, seconds until a trial request is let through; else None.
    """

    state: CircuitState
    consecutive_failures: int
    retry_in_s: float | None


@dataclass(slots=True)
class _Circuit:
    failures: int = 0
    open_until: float | None = None  # None: closed
    trial: bool = False  # a half-open trial request is in flight


class CircuitBreakers:
    """The circuits of every worker of one router replica.

    Args:
        config: Threshold and cooldown.
        on_open: Told each time a worker's circuit opens (counted in metrics).
        clock: Monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        config: BreakerConfig | None = None,
        on_open: Callable[[WorkerId], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or BreakerConfig()
        self._on_open = on_open
        self._clock = clock
        self._circuits: dict[WorkerId, _Circuit] = {}

    def state(self, worker_id: WorkerId) -> CircuitState:
        """The worker's state now."""
        circuit = self._circuits.get(worker_id)
        if circuit is None or circuit.open_until is None:
            return CircuitState.CLOSED
        if self._clock() < circuit.open_until:
            return CircuitState.OPEN
        return CircuitState.HALF_OPEN

    @property
    def all_closed(self) -> bool:
        """Whether every worker's circuit is closed (every worker routable)."""
        # NOTE: only workers that failed since their last success have a circuit here.
        return all(c.open_until is None for c in self._circuits.values())

    def routable(self, worker_id: WorkerId) -> bool:
        """Whether a new request may be sent to the worker now (without claiming a trial)."""
        state = self.state(worker_id)
        if state is CircuitState.HALF_OPEN:
            return not self._circuits[worker_id].trial
        return state is CircuitState.CLOSED

    def admit(self, worker_id: WorkerId) -> bool:
        """Claim the right to send one request to the worker now.

        A closed circuit always admits; a half-open one admits one trial at a time; an
        open one admits nothing. Every admitted request must end in :meth:`succeeded`,
        :meth:`failed` or :meth:`released`.
        """
        state = self.state(worker_id)
        if state is CircuitState.CLOSED:
            return True
        if state is CircuitState.OPEN:
            return False
        circuit = self._circuits[worker_id]
        if circuit.trial:
            return False
        circuit.trial = True
        return True

    def succeeded(self, worker_id: WorkerId) -> None:
        """The worker answered (not a 5xx): close its circuit."""
        self._circuits.pop(worker_id, None)

    def failed(self, worker_id: WorkerId, *, unreachable: bool = False) -> None:
        """The worker failed a request; ``unreachable``: it could not be reached at all.

        Opens the circuit (again) when it was not closed, when the failure threshold is
        reached, or when the worker is unreachable.
        """
        circuit = self._circuits.setdefault(worker_id, _Circuit())
        circuit.failures += 1
        circuit.trial = False
        if (
            unreachable
            or circuit.open_until is not None
            or circuit.failures >= self.config.failure_threshold
        ):
            circuit.open_until = self._clock() + self.config.cooldown_s
            if self._on_open is not None:
                self._on_open(worker_id)

    def released(self, worker_id: WorkerId) -> None:
        """An admitted request ended without a verdict on the worker (the client left)."""
        circuit = self._circuits.get(worker_id)
        if circuit is not None:
            circuit.trial = False

    def forget(self, worker_id: WorkerId) -> None:
        """Drop the worker's circuit (it was unregistered)."""
        self._circuits.pop(worker_id, None)

    def view(self, worker_id: WorkerId) -> CircuitView:
        """The worker's circuit as reported."""
        circuit = self._circuits.get(worker_id)
        state = self.state(worker_id)
        retry_in_s = None
        if state is CircuitState.OPEN and circuit is not None and circuit.open_until is not None:
            retry_in_s = round(max(circuit.open_until - self._clock(), 0.0), 3)
        return CircuitView(state, circuit.failures if circuit is not None else 0, retry_in_s)
