"""Idle watchdog: a worker's stream quiet for too long gets its position checked.

A SUB socket cannot tell a quiet publisher from a lost connection, and gaps show only
when the next batch arrives; a worker that published into a dead connection and then
went quiet would stay wrong in the index for good. Heartbeats
(:mod:`events.liveness`) make the connection come back; this makes the index catch up.

Every held worker whose live stream delivered nothing for ``idle_s`` (and that was not
checked within ``idle_s``), or whose connection dropped and was made again since the last
round (a heartbeat timeout, a reset: what it published meanwhile was lost), is asked where
its publisher is, with no lock held:

* a kvroute worker reports its lifetime id and next seq in ``GET /health``; a vLLM
  engine its lifetime (``process_start_time_seconds``), where it has an HTTP URL;
* :meth:`router.ingest.recovery.RecoveryRules.after_silence` says what that means, and
  it is carried out: nothing (``current``); a replay from the seq after the last one
  seen, which returns nothing when nothing was missed (``current``) or the missed
  batches (``replayed``); the worker's reset as after any unseen restart
  (``restarted``); a resync as after any loss (``resynced``: the replay failed, or there
  is none). When a quiet stream missed batches its connection is dropped and made again
  (``EventSubscriber.resubscribe``): the one in place evidently lost them. (Not after a
  reconnection, whose connection is new.)

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
from typing import Final

from events.cancellation import cancel_and_wait
from events.identity import WorkerId
from events.subscriber import EventSubscriber
from router.ingest.metrics import IngestMetrics
from router.ingest.recovery import Silence
from router.ingest.worker import WorkerIngest
from router.workers.lifetime import LifetimeTracker

__all__ = ["DEFAULT_IDLE_CHECK_S", "IdleWatchdog"]

log = logging.getLogger(__name__)

DEFAULT_IDLE_CHECK_S: Final = 30.0
"""Quiet seconds after which a stream is checked: the backstop for losses nothing else
shows (a reconnected stream is checked at once)."""


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
        # NOTE: worker id -> time.monotonic() of its last check; the checks in flight,
        # one per worker at most, each in a task of its own (a slow one delays no other).
        self._checked: dict[WorkerId, float] = {}
        self._inflight: dict[WorkerId, asyncio.Task[None]] = {}

    def why_due(self, worker: WorkerIngest) -> str | None:
        """Why ``worker`` is to be checked now: ``"quiet"`` (for ``idle_s`` since it was
        heard from and since its last check) or ``"reconnected"`` (since the last round);
        ``None`` when it is not, or not held, or busy."""
        if worker.lease is None or worker.is_busy:
            return None
        if self._subscriber.take_reconnected(worker.worker_id):
            return "reconnected"
        since_check = time.monotonic() - self._checked.get(worker.worker_id, float("-inf"))
        quiet = self._subscriber.idle_s(worker.worker_id)
        return "quiet" if min(quiet, since_check) >= self._idle_s else None

    def check(self, workers: Iterable[WorkerIngest]) -> None:
        """Start a check of every due worker among ``workers`` not being checked now."""
        for worker in workers:
            wid = worker.worker_id
            if wid in self._inflight or (why := self.why_due(worker)) is None:
                continue
            task = asyncio.create_task(self._run(worker, why), name=f"kvroute-idle-check[{wid}]")
            self._inflight[wid] = task

    async def close(self) -> None:
        """Stop the checks in flight."""
        await cancel_and_wait(list(self._inflight.values()))

    async def _run(self, worker: WorkerIngest, why: str) -> None:
        try:
            await self._check_one(worker, why)
        except Exception:  # a bug: the next round checks the worker again
            log.exception("worker %s: position check failed", worker.worker_id)
        finally:
            if self._inflight.get(worker.worker_id) is asyncio.current_task():
                del self._inflight[worker.worker_id]

    def forget(self, worker_id: WorkerId) -> None:
        """Drop what is kept about a worker no longer ingested (its check in flight is
        cancelled)."""
        self._checked.pop(worker_id, None)
        task = self._inflight.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _check_one(self, worker: WorkerIngest, why: str) -> None:
        """Check ``worker``'s position and act on it. Only a quiet stream's connection is
        made again when batches were missed: a connection just made again is new, and
        one that delivers may only be behind by what is in flight."""
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
            self._run_apart(
                worker, functools.partial(worker.recovery.check_lifetime, reported.lifetime_id)
            )
        elif silence is Silence.BEHIND:
            self._run_apart(worker, functools.partial(worker.recovery.resync, "idle_behind"))
            outcome = "resynced"
        elif silence is Silence.CATCH_UP:
            delivered = await self._subscriber.catch_up(wid, 0 if seen is None else seen + 1)
            outcome = {0: "current", None: "resynced"}.get(delivered, "replayed")
        self._metrics.idle_checks.labels(wid, outcome).inc()
        if outcome in ("current", "unknown"):
            return
        if why == "quiet":
            self._subscriber.resubscribe(wid)
        log.warning(
            "worker %s: position check (%s): %s (last seq applied %s, publisher %s)",
            wid,
            f"its stream was quiet for {self._idle_s:.0f} s or more"
            if why == "quiet"
            else "its connection dropped and was made again",
            outcome,
            seen,
            reported,
        )
