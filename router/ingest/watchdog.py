"""Idle watchdog: a worker's stream quiet for too long gets its position checked.

A SUB socket cannot tell a quiet publisher from a lost connection, and gaps show only
when the next batch arrives; a worker that published into a dead connection and then
went quiet would stay wrong in the index for good. Heartbeats
(:mod:`events.liveness`) make the connection come back; this makes the index catch up.

Every held worker whose live stream delivered nothing for ``idle_s`` (and that was not
checked within ``idle_s``) is asked where its publisher is, with no lock held:

* a kvroute worker reports its lifetime id and next seq in ``GET /health``; a vLLM
  engine its lifetime (``process_start_time_seconds``), where it has an HTTP URL;
* :meth:`router.ingest.recovery.RecoveryRules.after_silence` says what that means, and
  it is carried out: nothing (``current``); a replay from the seq after the last one
  seen, which returns nothing when nothing was missed (``current``) or the missed
  batches (``replayed``); the worker's reset as after any unseen restart
  (``restarted``); a resync as after any loss (``resynced``: the replay failed, or there
  is none). Whenever batches were missed the connection is dropped and made again
  (``EventSubscriber.resubscribe``): the one in place evidently lost them.

Each check is counted by outcome in ``kvroute_ingest_idle_checks_total``; each one that
found batches missed or a restart is logged (``current`` and ``unknown``, which a quiet
worker gives every round, are not).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from events.identity import WorkerId
from events.subscriber import EventSubscriber
from router.ingest.metrics import IngestMetrics
from router.ingest.recovery import Silence
from router.ingest.worker import WorkerIngest
from router.workers.lifetime import LifetimeTracker

__all__ = ["IdleWatchdog"]

log = logging.getLogger(__name__)


class IdleWatchdog:
    """Checks the position of held workers whose streams went quiet.

    Args:
        subscriber: The event subscriber (idle times, replays, resubscriptions).
        lifetimes: Reads what workers report and the lifetime ids recorded.
        metrics: Where outcomes are counted.
        idle_s: Silence after which a stream is checked (and between two checks).
        run_apart: Runs a worker's recovery step in a task of its own, under its lock
            (:meth:`router.ingest.ownership.LeaseKeeper.run_apart`): a reset or a
            resync may wait on the worker's snapshot, which no round waits on.
    """

    def __init__(
        self,
        subscriber: EventSubscriber,
        lifetimes: LifetimeTracker,
        metrics: IngestMetrics,
        idle_s: float,
        run_apart: Callable[[WorkerIngest, Callable[[], Awaitable[None]]], None],
    ) -> None:
        self._subscriber = subscriber
        self._lifetimes = lifetimes
        self._metrics = metrics
        self._idle_s = idle_s
        self._run_apart = run_apart
        # NOTE: worker id -> time.monotonic() of its last check.
        self._checked: dict[WorkerId, float] = {}

    def due(self, worker: WorkerIngest) -> bool:
        """Whether ``worker`` is held, not busy, and quiet for ``idle_s`` since it was
        heard from and since its last check."""
        if worker.lease is None or worker.is_busy:
            return False
        since_check = time.monotonic() - self._checked.get(worker.worker_id, float("-inf"))
        quiet = self._subscriber.idle_s(worker.worker_id)
        return min(quiet, since_check) >= self._idle_s

    async def check(self, workers: Iterable[WorkerIngest]) -> None:
        """Check every due worker among ``workers``, concurrently."""
        due = [w for w in workers if self.due(w)]
        await asyncio.gather(*(self._check_one(w) for w in due))

    def forget(self, worker_id: WorkerId) -> None:
        """Drop what is kept about a worker no longer ingested."""
        self._checked.pop(worker_id, None)

    async def _check_one(self, worker: WorkerIngest) -> None:
        wid = worker.worker_id
        self._checked[wid] = time.monotonic()
        reported = await self._lifetimes.report(worker.record)
        seen = worker.position.applied_through
        if seen is None:  # history given up: what was delivered since is what counts
            seen = self._subscriber.last_seq(wid)
        silence = worker.rules.after_silence(
            seen,
            self._lifetimes.recorded(wid),
            None if reported is None else reported.lifetime_id,
            None if reported is None else reported.next_seq,
        )
        outcome = silence.value
        if silence is Silence.RESTARTED:
            assert reported is not None
            self._subscriber.resubscribe(wid)
            self._run_apart(worker, functools.partial(worker.check_lifetime, reported.lifetime_id))
        elif silence is Silence.BEHIND:
            self._subscriber.resubscribe(wid)
            self._run_apart(worker, functools.partial(worker.resync, "idle_behind"))
            outcome = "resynced"
        elif silence is Silence.CATCH_UP:
            outcome = await self._catch_up(worker, -1 if seen is None else seen)
        self._metrics.idle_checks.labels(wid, outcome).inc()
        if outcome not in ("current", "unknown"):
            log.warning(
                "worker %s: its stream was quiet for %.0f s or more; position check: %s "
                "(last seq seen %s, publisher %s)",
                wid,
                self._idle_s,
                outcome,
                seen,
                reported,
            )

    async def _catch_up(self, worker: WorkerIngest, seen: int) -> str:
        """Replay from the seq after ``seen``; the outcome's name."""
        wid = worker.worker_id
        delivered = await self._subscriber.catch_up(wid, seen + 1)
        if delivered == 0:
            return "current"
        self._subscriber.resubscribe(wid)
        return "resynced" if delivered is None else "replayed"
