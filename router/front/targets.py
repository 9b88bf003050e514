"""A decision's forwarding order, built lazily: the chosen worker at once, the others only
if a fallback reaches them.

Nearly every request is answered by the chosen worker, so sorting every other candidate
by score for the fallback order (O(workers log workers): ~0.3 ms a request at 1,000
workers, ``bench_router``) is deferred until an attempt fails.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import overload

from events.identity import WorkerId
from router.front.proxy_contracts import ProxyTarget
from router.routing.policies import Decision
from router.workers.registry import WorkerRecord

__all__ = ["RankedTargets"]


class RankedTargets(Sequence[ProxyTarget]):
    """The candidates of a decision to forward to, best first (:meth:`Decision.ranked`).

    Args:
        decision: The decision.
        by_id: The candidates' records (every candidate's id must be in it).
    """

    def __init__(self, decision: Decision, by_id: Mapping[WorkerId, WorkerRecord]) -> None:
        self._decision = decision
        self._by_id = by_id
        self._first = self._target(decision.worker_id)
        self._ranked: tuple[ProxyTarget, ...] | None = None

    def _target(self, worker_id: WorkerId) -> ProxyTarget:
        return ProxyTarget(worker_id, self._by_id[worker_id].http_url or "")

    def _all(self) -> tuple[ProxyTarget, ...]:
        if self._ranked is None:
            rest = self._decision.ranked()[1:]
            self._ranked = (self._first, *(self._target(c.worker_id) for c in rest))
        return self._ranked

    def __len__(self) -> int:
        return len(self._decision.candidates)

    @overload
    def __getitem__(self, index: int) -> ProxyTarget: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ProxyTarget]: ...

    def __getitem__(self, index: int | slice) -> ProxyTarget | Sequence[ProxyTarget]:
        if index == 0:
            return self._first
        return self._all()[index]

    def __iter__(self) -> Iterator[ProxyTarget]:
        yield self._first
        yield from self._all()[1:]

    def __repr__(self) -> str:
        return f"RankedTargets(first={self._first!r}, of {len(self)})"
