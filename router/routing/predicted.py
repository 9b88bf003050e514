"""Predicted entries: the prefixes the router just routed, credited to their worker for a while.

A worker announces a block with ``BlockStored`` only once it has computed it, which is
after queueing and prefill. Siblings of a request that arrive before then would see no
worker holding their prefix and scatter over the cluster. Right after a decision the
router therefore credits the chosen worker with the request's keys for ``ttl_s``; lookups
treat a credited key like a cached GPU block. The same store, with a long TTL and no
events at all, is the route history of the ``approximate`` policy.

Time is passed in by the caller (``now_s``, any monotonic clock), so the store is pure
and the simulator can run it on simulated time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from events.hashing import BlockKey
from events.identity import WorkerId
from router.routing.cost import CostConfigError

__all__ = ["PredictedEntries"]


class PredictedEntries:
    """Short-lived (key, worker) credits with a memory bound.

    Args:
        ttl_s: How long a credit lasts after the decision that made it.
        max_entries: Bound on stored credits (up to ~350 bytes each); past it the oldest
            are dropped early (forgetting a prediction is safe, it only costs a possible
            cache miss). The default suits the simulator, whose route history must hold
            a whole trace; the router passes ``RouterConfig.predicted_max_entries``.

    NOTE: ``_expiry[worker][key]`` is the expiry of the newest credit of that pair; every
    credit also appends ``(expiry, worker, keys)`` to ``_order``, which is sorted by expiry
    because the TTL is fixed and ``now_s`` never decreases. A popped ``_order`` item
    deletes a pair only if the pair's expiry is still that item's (no newer credit).
    ``_num_ordered`` (the keys of all ``_order`` items) stays ``<= max_entries`` after every
    call, which bounds both structures. Per-worker tables let a credit be one C-level
    ``dict.update`` and a ``forget`` one ``pop``.
    """

    def __init__(self, ttl_s: float, max_entries: int = 1_000_000) -> None:
        if not ttl_s > 0:
            raise CostConfigError(f"predicted-entry ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise CostConfigError(f"predicted max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: dict[WorkerId, dict[BlockKey, float]] = {}
        self._order: deque[tuple[float, WorkerId, tuple[BlockKey, ...]]] = deque()
        self._num_ordered = 0

    def __len__(self) -> int:
        """Stored (key, worker) credits, expired ones not yet purged included."""
        return sum(len(keys) for keys in self._expiry.values())

    def credit(self, worker_id: WorkerId, keys: Sequence[BlockKey], now_s: float) -> None:
        """Credit ``worker_id`` with ``keys`` (a request's prefix) until ``now_s + ttl_s``."""
        if not keys:
            return
        expiry = now_s + self.ttl_s
        table = self._expiry.get(worker_id)
        if table is None:
            table = self._expiry[worker_id] = {}
        table.update(dict.fromkeys(keys, expiry))
        self._order.append((expiry, worker_id, tuple(keys)))
        self._num_ordered += len(keys)
        self._purge(now_s)

    def lookup(
        self, keys: Sequence[BlockKey], workers: Collection[WorkerId], now_s: float
    ) -> dict[WorkerId, int]:
        """Per worker, how many leading ``keys`` it is credited with.

        Args:
            keys: A request's router keys from block 0.
            workers: The candidates to report on (a set or mapping when many: only the
                credited workers are looked at then).
            now_s: The current time on the clock given to :meth:`credit`.

        Returns:
            Candidates credited with at least block 0, mapped to their prefix length.
        """
        self._purge(now_s)
        result: dict[WorkerId, int] = {}
        if not keys:
            return result
        first = keys[0]
        tables = self._expiry
        # The credited workers when fewer: O(credited workers), whatever the candidates.
        among = [w for w in tables if w in workers] if len(tables) < len(workers) else workers
        for worker in among:
            table = self._expiry.get(worker)
            if table is None or table.get(first, 0.0) <= now_s:
                continue
            # Every credit covers a prefix from block 0, so along one chain a worker's
            # expiries never increase with depth (purges drop the oldest first, which
            # keeps that): its credited depth is found by binary search, O(log keys)
            # per worker instead of O(keys) (bench_router, 64 workers).
            lo, hi = 1, len(keys)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if table.get(keys[mid - 1], 0.0) > now_s:
                    lo = mid
                else:
                    hi = mid - 1
            result[worker] = lo
        return result

    def forget(self, worker_id: WorkerId) -> None:
        """Drop every credit of a worker (it left, restarted or was resynced)."""
        self._expiry.pop(worker_id, None)
        # _order keeps the worker's items; they are skipped when popped (pair absent).

    def _purge(self, now_s: float) -> None:
        order = self._order
        tables = self._expiry
        while order and (order[0][0] <= now_s or self._num_ordered > self.max_entries):
            expiry, worker_id, keys = order.popleft()
            self._num_ordered -= len(keys)
            table = tables.get(worker_id)
            if table is None:
                continue
            for key in keys:
                if table.get(key) == expiry:
                    del table[key]
            if not table:
                del tables[worker_id]
