"""Recent work per worker: requests routed to it and prefill tokens it was given, decayed.

The cost model's fair-share term (:attr:`router.routing.cost.CostWeights.fair_share`)
compares each worker's recent share of the cluster's requests and computed tokens with
the mean. Instantaneous load cannot do that job: between bursts every queue is empty, yet
a worker that keeps attracting the new families of a popular prefix ends up serving (and
caching for) several times its share. Recent work also says where the cache churns: a
worker given more new tokens than the others evicts younger blocks, so keeping the shares
even keeps every worker's cache as old as one pooled LRU cache would be.

:class:`WorkShares` is the record the shells keep (the router service per replica, the
simulator per run); decisions read it through :class:`router.routing.decider.DecisionInputs`
and the decision log records what each candidate was credited with, so ``kvroute explain``
re-makes the decision without it. Time is passed in by the caller (``now_s``, any monotonic
clock), as for :class:`router.routing.predicted.PredictedEntries`.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Final

from events.identity import WorkerId
from router.routing.cost import CostConfigError, RecentWork

__all__ = ["WorkShares"]


_NONE: Final = RecentWork()
_RENORMALIZE_HALF_LIVES: Final = 256.0  # 2**256 ~ 1e77: far from float overflow


class WorkShares:
    """Exponentially decayed requests and prefill tokens per worker.

    Args:
        half_life_s: Age at which a routed request counts half.

    NOTE: ``_work[w]`` holds the worker's figures scaled to the origin ``_origin_s``: a
    request added at ``t`` counts ``2 ** ((t - _origin_s) / half_life_s)``, so reading
    every figure at ``now_s`` takes one common factor ``2 ** (-(now_s - _origin_s) /
    half_life_s)`` (one ``pow`` per decision, not one per worker). ``now_s`` never
    decreases between calls (a monotonic clock); the origin moves forward before the
    scaled figures could overflow.
    """

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise CostConfigError(f"fair-share half-life must be > 0 s, got {half_life_s}")
        self.half_life_s = half_life_s
        self._origin_s: float | None = None
        self._work: dict[WorkerId, tuple[float, float]] = {}

    def _scale(self, now_s: float) -> float:
        """``2 ** ((now_s - origin) / half_life)``, moving the origin to ``now_s`` first
        when that factor grows too large."""
        if self._origin_s is None:
            self._origin_s = now_s
        half_lives = (now_s - self._origin_s) / self.half_life_s
        if half_lives > _RENORMALIZE_HALF_LIVES:
            shrink = 0.5**half_lives
            self._work = {w: (r * shrink, t * shrink) for w, (r, t) in self._work.items()}
            self._origin_s, half_lives = now_s, 0.0
        return float(2.0**half_lives)

    def add(self, worker_id: WorkerId, prefill_tokens: int, now_s: float) -> None:
        """Count one request routed to ``worker_id`` with that much prefill, at ``now_s``."""
        scale = self._scale(now_s)
        requests, tokens = self._work.get(worker_id, (0.0, 0.0))
        self._work[worker_id] = (requests + scale, tokens + prefill_tokens * scale)

    def snapshot(self, workers: Iterable[WorkerId], now_s: float) -> dict[WorkerId, RecentWork]:
        """Each of ``workers``' recent work at ``now_s`` (zero for a worker never given any)."""
        if not self._work:
            return {}
        recorded = self.recorded(self._work, now_s)
        return {w: recorded.get(w, _NONE) for w in workers}

    def recorded(self, candidates: Container[WorkerId], now_s: float) -> dict[WorkerId, RecentWork]:
        """The recent work of the ``candidates`` that were given any (the others: none),
        in O(workers given work), whatever the number of candidates."""
        keep = 1.0 / self._scale(now_s) if self._work else 1.0
        return {
            w: RecentWork(requests * keep, tokens * keep)
            for w, (requests, tokens) in self._work.items()
            if w in candidates
        }

    def forget(self, worker_id: WorkerId) -> None:
        """Drop a worker's record (it left, restarted or was resynced)."""
        self._work.pop(worker_id, None)
