"""Worker liveness: which registered workers stayed unreachable too long, and which to revive.

A worker whose HTTP front stops answering keeps its registration and index entries for a
grace period (a restart or a short partition costs nothing); past ``dead_after_s`` it is
retired: the caller unregisters it and drops its entries, and keeps its record here so a
worker that answers again is registered anew. The rules are pure; the caller does the
polling and the registry's I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from events.identity import WorkerId
from router.workers.registry import WorkerRecord

__all__ = ["Liveness"]


class Liveness:
    """Unreachable-since times of registered workers, and the records of retired ones.

    Args:
        dead_after_s: How long a worker may stay unreachable before it is retired.

    NOTE: a worker is in at most one of the two maps: ``_since`` holds registered workers
    seen unreachable, ``_retired`` workers unregistered for it (their records kept).
    """

    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self._since: dict[WorkerId, float] = {}
        self._retired: dict[WorkerId, WorkerRecord] = {}

    def overdue(
        self, workers: Iterable[WorkerId], is_reachable: Callable[[WorkerId], bool], now: float
    ) -> list[WorkerId]:
        """Note who answers now; the workers unreachable for ``dead_after_s`` or longer."""
        out: list[WorkerId] = []
        for wid in workers:
            if is_reachable(wid):
                self._since.pop(wid, None)
            elif now - self._since.setdefault(wid, now) >= self.dead_after_s:
                out.append(wid)
        return out

    def retire(self, record: WorkerRecord) -> None:
        """Keep the record of a worker just unregistered for being unreachable."""
        wid = record.worker_id
        self._since.pop(wid, None)
        self._retired[wid] = record

    def forget(self, worker_id: WorkerId) -> None:
        """Stop tracking a worker (registered anew, or removed on purpose)."""
        self._since.pop(worker_id, None)
        self._retired.pop(worker_id, None)

    def is_retired(self, worker_id: WorkerId) -> bool:
        """Whether the worker was unregistered for being unreachable (and not since)."""
        return worker_id in self._retired

    @property
    def retired(self) -> list[WorkerRecord]:
        """Records of the retired workers, to probe for their return."""
        return list(self._retired.values())
