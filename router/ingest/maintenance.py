"""The ingest's maintenance: the periodic pass over its workers, and the lease renewal task.

Every pass (:meth:`IngestMaintenance.maintain_once`) renews this router's heartbeat (and
the leases, when their own renewal task is late), probes a Redis that refused writes,
restores the workers whose entries a Redis node lost (:mod:`router.store.markers`),
follows the saved registrations, takes, hands over or rebuilds each worker's lease
(:mod:`router.ingest.ownership`), publishes the block size flags, reaps workers whose
lease lapsed (their router died) and checks the held workers' lifetimes
(:mod:`router.ingest.lifetime_checks`).

It also keeps the ingest's write health: a write that failed on a Redis error makes the
index unwritable until a pass completes with no write failed since the pass before
(:attr:`IngestMaintenance.writable`; the write gate covers out-of-memory apart).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from redis.exceptions import RedisError

from events.identity import WorkerId
from router.ingest.bridged_index import BridgedIndex
from router.ingest.lifetime_checks import LifetimeChecks
from router.ingest.metrics import IngestMetrics
from router.ingest.ownership import LeaseKeeper
from router.ingest.worker import WorkerIngest
from router.ingest.write_gate import WriteGate, shut_reason
from router.store.markers import DataMarkers
from router.workers.lifetime import LifetimeTracker
from router.workers.registry import WorkerRegistry

__all__ = ["IngestMaintenance"]

log = logging.getLogger(__name__)


class IngestMaintenance:
    """The maintenance of one ingest's workers, and whether Redis takes its writes.

    Args:
        workers: The ingest's workers (worker id -> its ingest); read, never written.
        index: The index the ingest writes.
        registry: Registrations and leases of the same namespace.
        metrics: Where counters go.
        leases: The ingest's lease keeper.
        gate: The ingest's write gate.
        lifetime_checks: The held workers' lifetime checks.
        interval_s: The period of the pass and of the lease renewal.
        sync_registry: Follows the saved registrations.
        is_current: Whether a worker is still the one ingested under its id.
        tracker: The ingest's lifetime tracker (asked only once the ingest started).
    """

    def __init__(
        self,
        workers: Mapping[WorkerId, WorkerIngest],
        index: BridgedIndex,
        registry: WorkerRegistry,
        metrics: IngestMetrics,
        leases: LeaseKeeper,
        gate: WriteGate,
        lifetime_checks: LifetimeChecks,
        interval_s: float,
        *,
        sync_registry: Callable[[], Awaitable[None]],
        is_current: Callable[[WorkerIngest], bool],
        tracker: Callable[[], LifetimeTracker],
    ) -> None:
        self._workers = workers
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self._leases = leases
        self._gate = gate
        self._lifetime_checks = lifetime_checks
        self._interval_s = interval_s
        self._sync_registry = sync_registry
        self._is_current = is_current
        self._tracker = tracker
        self.markers = DataMarkers(registry.client, registry.layout, registry.owner)
        self._renewed_at = float("-inf")
        # NOTE: _writable is False from a failed write until a maintenance pass completes
        # with no write failed since the pass before (the gate covers out-of-memory apart).
        self._writable = True
        self._write_errors = 0
        self._write_errors_seen = 0  # as of the end of the last maintenance pass

    @property
    def writable(self) -> bool:
        """False from a write that failed on a Redis error until a pass completes with no
        write failed since the pass before."""
        return self._writable

    def note_write_error(self, exc: Exception) -> None:
        """Count a failed write (only a Redis error makes the index unwritable)."""
        if isinstance(exc, RedisError):
            self._writable = False
            self._write_errors += 1

    async def renew_leases(self) -> None:
        """Renew the held leases and this router's heartbeat (a task of its own: it waits
        on no worker's ingest). Redis errors are logged; the next round retries."""
        try:
            await self._leases.renew(self._workers.values())
            self._renewed_at = time.monotonic()
        except RedisError as exc:
            self.note_write_error(exc)  # renewals and heartbeats are writes
            self._redis_failed(exc, "lease renewal")

    async def maintain_once(self) -> None:
        """Renew leases (unless the renewal task keeps them renewed: then only this
        router's heartbeat), sync registrations, take or hand over leases, rebuild what
        needs it, publish block size flags, reap lapsed workers, check the workers'
        lifetimes.

        Redis errors are logged and counted; the next pass retries. A worker whose lock
        is busy (its ingest is at work) is skipped: no pass waits on one worker.
        """
        if time.monotonic() - self._renewed_at < 1.5 * self._interval_s:
            # The renewal task keeps the leases renewed: only learn the live routers now
            # (renewing here too would double the renewals); past 1.5 periods it is late.
            try:
                await self._leases.heartbeat()
            except RedisError as exc:
                self.note_write_error(exc)
                self._redis_failed(exc, "heartbeat")
        else:
            await self.renew_leases()
        try:
            await self._gate.probe()
            await self._check_markers()
            for worker in self._workers.values():
                # A worker this router owns but does not hold is being handed to it (or
                # will be taken): keep its batches from now on, as the lease may come with
                # the previous holder's state, which they continue.
                if worker.lease is None:
                    worker.keep_batches(self._leases.owns(worker.worker_id))
            await self._sync_registry()
            for worker in list(self._workers.values()):
                if self._is_current(worker):  # not removed since this pass listed it
                    await self._leases.maintain(worker, functools.partial(self._is_current, worker))
            await self._publish_flags()
            reaped = await self.registry.reap(
                self.index.store, set(self._workers), self._leases.live_holders
            )
            self.metrics.reaped.inc(len(reaped))
            self._writable = self._write_errors == self._write_errors_seen
        except RedisError as exc:
            self._writable = False
            self._redis_failed(exc, "maintenance")
        self._write_errors_seen = self._write_errors
        await self._check_lifetimes()
        self.metrics.owned.set(sum(w.lease is not None for w in self._workers.values()))

    async def _check_markers(self) -> None:
        """If a Redis node lost its data (:mod:`router.store.markers`), mark every worker
        whose entries this router holds, or held until the loss, for a restore from its
        bridge (done by this pass: the leases that went with the data are dropped now, so
        the pass takes them again), then set the markers again."""
        lost = await self.markers.lost()
        if not lost:
            return
        self.metrics.data_losses.inc(len(lost))
        marked = 0
        for worker in self._workers.values():
            if worker.lease is not None or worker.restorable:
                worker.restore_pending = True
                marked += 1
        log.warning(
            "Redis lost its data (markers %s gone: restarted empty, or a shard flushed); "
            "writing the entries of the %d workers this router holds again",
            ", ".join(lost),
            marked,
        )
        await self._leases.renew(self._workers.values(), force=True)
        await self.markers.write()

    def _redis_failed(self, exc: RedisError, what: str) -> None:
        if shut_reason(exc) is not None:
            self._gate.refused(exc, what)
        else:
            log.warning("ingest %s: Redis error (%s); retrying next pass", what, exc)

    async def _publish_flags(self) -> None:
        """Record in Redis which held workers' events disagree with their block size."""
        for worker in list(self._workers.values()):
            if worker.lease is not None and not worker.flag_synced:
                seen = worker.events_block_size
                await self.registry.flag_block_size(worker.worker_id, seen)
                worker.flag_synced = seen == worker.events_block_size  # unless it changed

    async def _check_lifetimes(self) -> None:
        """Check the held workers' lifetimes (:mod:`router.ingest.lifetime_checks`)."""
        if not self._gate.is_open:
            return  # a reset could not be written; the rebuild after it covers restarts
        held = [w for w in self._workers.values() if w.lease is not None]
        await self._lifetime_checks.run(
            self._tracker(), held, self._is_current, self._leases.run_apart
        )
