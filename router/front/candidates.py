"""Which registered workers a new request may go to: its model's, whose circuit admits it.

A worker's circuit (:mod:`router.front.breaker`) keeps a failing worker out of routing
decisions for a while; one past its cooldown takes new requests only once it answered the
last ``GET /health`` poll, so no client's request is the trial of a worker still cut off.
:meth:`RoutableWorkers.readiness` says whether any worker is routable at all (``GET
/ready``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from events.identity import WorkerId
from router.errors import RouterError
from router.front.breaker import CircuitBreakers, CircuitState
from router.front.worker_view import CandidateSet, WorkerView

__all__ = ["NoWorkersError", "Readiness", "RoutableWorkers"]


class NoWorkersError(RouterError):
    """No worker is registered, or every one's circuit is open: nothing to route to."""


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the replica can serve requests now (``GET /ready``).

    Attributes:
        ready: At least one worker is routable (its circuit is not open and its last
            ``GET /health`` poll got an answer). The index never makes a replica unready:
            it is writable, or routing has degraded to load alone, explicitly.
        reasons: Why it is not ready (empty when ready).
        routable_workers: The routable workers, sorted.
    """

    ready: bool
    reasons: tuple[str, ...]
    routable_workers: tuple[str, ...]


class RoutableWorkers:
    """The candidates of new requests among a replica's workers.

    Args:
        view: The replica's workers.
        breakers: The workers' circuits.
        is_reachable: Whether a worker answered its last ``GET /health`` poll.
    """

    def __init__(
        self,
        view: WorkerView,
        breakers: CircuitBreakers,
        is_reachable: Callable[[WorkerId], bool],
    ) -> None:
        self._view = view
        self.breakers = breakers
        self._is_reachable = is_reachable

    def select(self, model: str | None) -> tuple[str | None, CandidateSet]:
        """The model a request is for and the workers serving it (see
        :meth:`router.workers.models.WorkerModels.select`), circuits not considered.

        Raises:
            NoWorkersError: No worker with an HTTP URL is registered.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        if not self._view.proxied:
            raise NoWorkersError(
                "no worker with an HTTP URL is registered: add one with POST /v1/workers"
            )
        return self._view.select(model)

    def for_request(self, model: str | None) -> CandidateSet:
        """Workers a new request for ``model`` may go to.

        Raises:
            NoWorkersError: None is registered, or every one's circuit is open.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        _, candidates = self.select(model)
        if self.breakers.all_closed:  # the common case: no per-worker check
            return candidates
        records = candidates.records
        routable = [r for r in records if self.routable(r.worker_id)]
        if not routable:
            raise NoWorkersError(
                "every worker is failing and skipped for now: "
                + "; ".join(self.circuit_text(r.worker_id) for r in records)
            )
        return CandidateSet.of(routable)

    def routable(self, worker_id: WorkerId) -> bool:
        """Whether new requests may go to the worker: its circuit admits them, and one
        past its cooldown (its trial due) answered the last ``GET /health`` poll, so no
        client's request is the trial of a worker still cut off."""
        if not self.breakers.routable(worker_id):
            return False
        closed = self.breakers.state(worker_id) is CircuitState.CLOSED
        return closed or self._is_reachable(worker_id)

    def circuit_text(self, worker_id: WorkerId) -> str:
        """Why the worker takes no new request now (or, in a half-open circuit, soon)."""
        view = self.breakers.view(worker_id)
        if view.retry_in_s is not None:
            return f"{worker_id} circuit open (next trial in {view.retry_in_s:.1f} s)"
        if view.state is CircuitState.HALF_OPEN and not self._is_reachable(worker_id):
            return f"{worker_id} circuit half_open (no trial before it answers GET /health)"
        return f"{worker_id} circuit {view.state.value} (a trial request is in flight)"

    def readiness(self) -> Readiness:
        """Whether this replica can serve requests now, and why not."""
        records = self._view.proxied
        if not records:
            return Readiness(False, ("no worker with an HTTP URL is registered",), ())
        routable: list[str] = []
        problems: list[str] = []
        for record in records:
            wid = record.worker_id
            if self.breakers.state(wid) is CircuitState.OPEN:
                problems.append(self.circuit_text(wid))
            elif not self._is_reachable(wid):
                problems.append(f"{wid} gives no answer to GET /health")
            else:
                routable.append(wid)
        if routable:
            return Readiness(True, (), tuple(routable))
        return Readiness(False, ("no routable worker: " + "; ".join(problems),), ())
