"""Periodic lifetime checks of the workers a router holds: heard from its load polls, or asked.

A restart whose first batches were lost, of a worker that publishes nothing since, shows
nowhere but in the worker's lifetime id (:mod:`router.workers.lifetime`). Every
maintenance pass checks the held workers: with the lifetime ids the router's load polls
read from the same ``/health`` or ``/metrics`` answers (:meth:`LifetimeChecks.hear`), else
by asking the worker, at every pass while its answer changes and less and less often while
it stays the same (at least every :data:`LIFETIME_BACKOFF` passes). A new lifetime resets
the worker (:meth:`router.ingest.worker_recovery.WorkerRecovery.check_lifetime`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

from events.identity import WorkerId
from router.ingest.worker import WorkerIngest
from router.store.connection import gather_bounded
from router.tasks.quiet_schedule import QuietSchedule
from router.workers.lifetime import LifetimeTracker

__all__ = ["LIFETIME_BACKOFF", "LifetimeChecks"]

LIFETIME_BACKOFF: Final = 16
"""A held worker whose lifetime stays the same is asked at least every this many passes
(53 s at the default TTL: longer than the router's load polls take to come back to a quiet
worker of 1,000, 40 s, so the lifetime they read comes first and nothing is asked)."""


class LifetimeChecks:
    """The lifetime checks of one router's held workers.

    Args:
        interval_s: The maintenance pass's period.
    """

    def __init__(self, interval_s: float) -> None:
        self._schedule: QuietSchedule[WorkerId] = QuietSchedule(
            interval_s, LIFETIME_BACKOFF * interval_s
        )
        # NOTE: worker -> the lifetime id heard since the last pass.
        self._heard: dict[WorkerId, str] = {}

    def hear(self, worker_id: WorkerId, lifetime_id: str) -> None:
        """A worker's lifetime id as someone else read it: the next pass checks it
        instead of asking the worker."""
        self._heard[worker_id] = lifetime_id

    def forget(self, worker_id: WorkerId) -> None:
        """Stop checking a worker (no longer ingested)."""
        self._schedule.forget(worker_id)
        self._heard.pop(worker_id, None)

    async def run(
        self,
        tracker: LifetimeTracker,
        held: Iterable[WorkerIngest],
        is_current: Callable[[WorkerIngest], bool],
        run_apart: Callable[[WorkerIngest, Callable[[], Awaitable[None]]], None],
    ) -> None:
        """Check the ``held`` workers that were heard of or are due (asked a bounded
        number at once, with no lock held) and reset the ones that restarted unseen,
        through ``run_apart`` (a reset loads the worker's snapshot, which no pass may wait
        on); a busy worker, or one no longer ``is_current``, waits for the next pass."""
        by_id = {w.worker_id: w for w in held}
        heard, self._heard = self._heard, {}
        told = [(by_id[wid], lifetime) for wid, lifetime in heard.items() if wid in by_id]
        schedule, now = self._schedule, time.monotonic()
        for worker, lifetime in told:  # not asked again while the load polls tell it
            schedule.observed(worker.worker_id, lifetime, now)
        due = [by_id[wid] for wid in schedule.due(by_id, now)]
        due = [w for w in due if tracker.can_tell(w.record)]
        found = await gather_bounded(tracker.current(w.record) for w in due)
        now = time.monotonic()
        for worker, current in zip(due, found, strict=True):
            schedule.observed(worker.worker_id, current, now, healthy=current is not None)
        for worker, current in [*told, *zip(due, found, strict=True)]:
            if current is None or current == tracker.recorded(worker.worker_id):
                continue  # the common case: nothing to do, no lock taken
            if worker.is_busy or not is_current(worker):
                continue  # its ingest is at work (and may see it); the next pass will
            run_apart(worker, functools.partial(worker.recovery.check_lifetime, current))
