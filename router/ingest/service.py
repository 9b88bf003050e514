"""Event ingest: folds every registered worker's KV event stream into the Redis prefix index.

:class:`IndexIngest` is the :class:`events.subscriber.EventSink` of one
:class:`events.subscriber.EventSubscriber` over all registered workers. Per worker:

* it writes only while it holds the worker's lease (renewed every third of its TTL by a
  task of its own that waits on no worker's ingest); on acquiring one it resumes from the
  previous holder's handoff, or drops the worker's old entries and rebuilds them: from
  ``GET /v1/snapshot`` for kvroute workers, by replay from seq 0 for others;
* each batch is one fenced Redis script call, or shares one with the batches that arrive
  while the previous write is in flight (group commit); a batch already covered (by a
  snapshot or an earlier delivery) is skipped by seq;
* a ``BlockStored`` with an unknown parent is counted and triggers a replay from seq 0
  (entries cleared first; the replay is fetched with the worker's lock set down, within
  an overall deadline); if replay cannot help, a resync: clear, then the snapshot
  (kvroute workers) or tolerant mode (others: orphans are stored detached, counted,
  never indexed);
* a ``BlockStored`` whose block size is not the worker's registered one is counted and
  dropped, and the worker flagged (``/metrics``, Redis for ``/v1/workers`` and
  ``kvroute index check``);
* a publisher restart clears the worker. A restart shows as a seq drop, or as a change of
  the worker's lifetime (:mod:`router.workers.lifetime`: the id in a kvroute worker's
  ``GET /health``, a vLLM engine's ``process_start_time_seconds``), checked on every seq
  jump before it is replayed as a gap, on the first batch after a reconnect and by the
  maintenance passes (every pass, backing off for a worker whose answer stays the same),
  so a restart whose first batches were lost is never taken for a gap or for the old
  lifetime going on;
* a stream quiet for longer than the idle bound has its position checked against its
  publisher's (:mod:`router.ingest.watchdog`): batches it missed on a connection that
  died half-open are replayed (or the worker resynced) and the connection made again;
* while Redis refuses writes for lack of memory, batches are dropped and counted, one
  warning per interval says so, and the workers are rebuilt once it takes writes again
  (:mod:`router.ingest.write_gate`; :attr:`IndexIngest.index_writable`);
* a lost lease or a Redis failure (e.g. Redis restarted empty) marks the worker for a
  rebuild, which the maintenance pass or the next batch performs.

Router replicas share the ingest (:mod:`router.ingest.ownership`: which replica holds which
worker's lease, and how leases move with the previous holder's state of the worker). A
router keeps the batches (and publisher restarts) it receives for a worker it owns but
does not hold yet, so the ones published while the lease moves are applied too, even from
a vLLM engine without a replay endpoint; it subscribes before its first heartbeat
announces it, so they reach it.

Registrations persist in Redis (:class:`router.workers.registry.WorkerRegistry`), so a
restarted router resumes the same workers; a maintenance pass also reaps workers whose
lease lapsed (their router died).

This module holds the event sink and the ingest's life; the workers ingested are an
:class:`router.ingest.membership.IngestMembership`, the maintenance pass an
:class:`router.ingest.maintenance.IngestMaintenance`, the leases a
:class:`router.ingest.ownership.LeaseKeeper`, each worker's batch path a
:class:`router.ingest.worker.WorkerIngest` and its recovery paths a
:class:`router.ingest.worker_recovery.WorkerRecovery`, and which rebuild follows which loss
is decided by :mod:`router.ingest.recovery` (shared with the offline replay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence

import aiohttp
from redis.exceptions import RedisError

from events.curve import CurveClientConfig
from events.identity import WorkerId
from events.subscriber import EventSubscriber, ReceivedBatch, WorkerCounters, WorkerStream
from router.index.group_commit import GroupCommitIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.capacity import FleetCapacity, fd_limit
from router.ingest.config import IngestConfig
from router.ingest.lifetime_checks import LifetimeChecks
from router.ingest.maintenance import IngestMaintenance
from router.ingest.membership import IngestMembership
from router.ingest.metrics import IngestMetrics, StreamCollector
from router.ingest.ownership import RECOVERY_ERRORS, LeaseKeeper
from router.ingest.watchdog import IdleWatchdog
from router.ingest.worker import IngestServices, WorkerIngest
from router.ingest.write_gate import WriteGate
from router.tasks.periodic import Periodic
from router.workers.lifetime import LifetimeTracker
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry

__all__ = ["IndexIngest"]

log = logging.getLogger(__name__)


class IndexIngest:
    """Folds registered workers' event streams into a shared prefix index (an ``EventSink``).

    Args:
        index: The prefix index it writes (a Redis store in production) through the
            workers' bridges.
        registry: Registrations and leases of the same namespace.
        config: Periods, timeouts and subscriber settings.
        metrics: Where counters go (a private registry by default).
    """

    def __init__(
        self,
        index: BridgedIndex,
        registry: WorkerRegistry,
        config: IngestConfig | None = None,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.config = config or IngestConfig()
        if self.config.group_commit:  # wrapped before the index writes anything
            index.store = GroupCommitIndex(index.store, on_error=self._write_failed)
        self.metrics = metrics or IngestMetrics()
        self._workers: dict[WorkerId, WorkerIngest] = {}
        self._subscriber: EventSubscriber | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lifetimes: LifetimeTracker | None = None
        self._capacity: FleetCapacity | None = None
        self._lifetime_checks = LifetimeChecks(self.config.maintain_interval_s)
        self._services: IngestServices | None = None
        self._watchdog: IdleWatchdog | None = None
        # The watchdog looks often; each worker is checked at most once per idle bound.
        self._watcher = Periodic(self._check_idle, min(1.0, self.config.idle_check_s / 4))
        self._gate = WriteGate(
            registry.client,
            self.metrics,
            retry_max_s=self.config.write_retry_max_s,
            log_interval_s=self.config.subscriber.log_interval_s,
        )
        self._leases = LeaseKeeper(index, registry, self.metrics, self._gate)
        self._membership = IngestMembership(
            self._workers,
            registry,
            self._leases,
            subscribe=self._subscribe,
            unsubscribe=self._unsubscribe,
            is_current=self._is_current,
        )
        self._maintenance = IngestMaintenance(
            self._workers,
            index,
            registry,
            self.metrics,
            self._leases,
            self._gate,
            self._lifetime_checks,
            self.config.maintain_interval_s,
            sync_registry=self._membership.sync,
            is_current=self._is_current,
            tracker=lambda: self._tracker,
        )
        self._maintainer = Periodic(self.maintain_once, self.config.maintain_interval_s)
        self._renewer = Periodic(self._maintenance.renew_leases, self.config.maintain_interval_s)

    @property
    def ingested_workers(self) -> list[WorkerId]:
        """Workers whose event streams this router reads, sorted."""
        return sorted(self._workers)

    @property
    def owned_workers(self) -> list[WorkerId]:
        """Workers whose lease this router holds, sorted."""
        return sorted(w.worker_id for w in self._workers.values() if w.lease is not None)

    @property
    def index_writable(self) -> bool:
        """Whether Redis takes this router's index writes.

        False while Redis refuses them for lack of memory (``maxmemory``: batches are then
        dropped, counted, and the workers rebuilt once it takes them again), and from any
        other write that fails on a Redis error (read-only, unanswered) until a
        maintenance pass completes with no write failed since the pass before. A lost
        lease is no such failure.
        """
        return self._gate.is_open and self._maintenance.writable

    @property
    def index_full(self) -> bool:
        """True while Redis refuses index writes for lack of memory (``maxmemory``)."""
        return self._gate.is_full

    @property
    def events_block_sizes(self) -> dict[WorkerId, int]:
        """The workers held here whose events carry a block size other than their
        registration's: worker id -> that block size."""
        return {
            w.worker_id: w.events_block_size
            for w in self._workers.values()
            if w.events_block_size is not None
        }

    async def start(self, records: Sequence[WorkerRecord] = ()) -> None:
        """Register ``records``, subscribe to every registered worker, take the leases
        this router owns (the snapshots of kvroute workers loaded before it returns; each
        within the snapshot timeout), start maintenance."""
        key = self.config.worker_admin_key
        self._session = aiohttp.ClientSession(
            headers={} if key is None else {"Authorization": key.authorization}
        )
        self._lifetimes = LifetimeTracker(self._session, self.config.lifetime_timeout_s)
        self._subscriber = EventSubscriber(self, self.config.subscriber)
        self._capacity = FleetCapacity(fd_limit(), self.config.subscriber.max_sockets)
        self._capacity.check(len(records))  # the operator's own workers must all fit
        await self._maintenance.markers.write()
        self._services = IngestServices(
            index=self.index,
            metrics=self.metrics,
            subscriber=self._subscriber,
            session=self._session,
            lifetimes=self._lifetimes,
            gate=self._gate,
            snapshot_timeout_s=self.config.snapshot_timeout_s,
            snapshot_chunk_runs=self.config.snapshot_chunk_runs,
        )
        self.metrics.registry.register(StreamCollector(self._stream_counters))
        if self.config.idle_check_s > 0:
            self._watchdog = IdleWatchdog(
                self._subscriber,
                self._lifetimes,
                self.metrics,
                self.config.idle_check_s,
                self._leases.run_apart,
            )
        # Subscribe before the first heartbeat announces this router: the others hand
        # it their workers from then on, and what they publish meanwhile must arrive.
        await self._membership.start(records)
        await self.maintain_once()
        await self._leases.settle()  # the snapshots taken at the first pass are in
        self._renewer.start("kvroute-lease-renewal", wait_first=True)
        self._maintainer.start("kvroute-ingest", wait_first=True)
        if self._watchdog is not None:
            self._watcher.start("kvroute-idle-watchdog", wait_first=True)

    async def close(self) -> None:
        """Stop maintenance and the subscriber; hand every held lease on (entries stay).

        Each worker goes, with this router's state of it, to its owner among the other
        live routers, or is parked for whichever router starts next when none is left
        (so a restarted router resumes it without a rebuild).
        """
        await self._maintainer.stop()
        await self._renewer.stop()
        await self._watcher.stop()
        if self._watchdog is not None:
            await self._watchdog.close()
        await self._leases.close()
        with contextlib.suppress(RedisError):
            await self.registry.leave()  # the others own our workers from their next pass
        if self._subscriber is not None:
            await self._subscriber.close()
        for worker in self._workers.values():
            async with worker.lock.hold():
                with contextlib.suppress(RedisError):
                    await self._leases.pass_on(worker, self._leases.successor(worker.worker_id))
        await self.index.close()
        if self._session is not None:
            await self._session.close()

    async def add_worker(self, record: WorkerRecord, *, replace: bool = False) -> Outcome:
        """Start ingesting a worker, then save its registration (see
        :meth:`router.ingest.membership.IngestMembership.add_worker`)."""
        return await self._membership.add_worker(record, replace=replace)

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        """Stop ingesting a worker, drop its entries and its registration (see
        :meth:`router.ingest.membership.IngestMembership.remove_worker`)."""
        return await self._membership.remove_worker(worker_id)

    async def _unsubscribe(self, worker: WorkerIngest) -> None:
        """Stop reading ``worker``'s stream, drop its entries and release its lease."""
        wid = worker.worker_id
        del self._workers[wid]
        if self._watchdog is not None:
            self._watchdog.forget(wid)
        if self._subscriber is not None:
            await self._subscriber.remove_worker(wid)
        if self._lifetimes is not None:
            self._lifetimes.forget(wid)
        self._lifetime_checks.forget(wid)
        self.index.expect_block_size(wid, 0)
        with contextlib.suppress(KeyError):
            self.metrics.block_size_mismatch.remove(wid)
        async with worker.lock.hold():  # waits for a maintenance step in flight
            if worker.lease is not None:
                await self.index.clear_worker(wid)
                self.index.forget_lease(wid)
                await self.registry.release(worker.lease)
                worker.lease = None

    def hear_lifetime(self, worker_id: WorkerId, lifetime_id: str) -> None:
        """A worker's lifetime id as read by someone else (the load poller, from the
        same ``/health`` or ``/metrics`` answer): the next maintenance pass checks it
        instead of asking the worker."""
        if worker_id in self._workers:
            self._lifetime_checks.hear(worker_id, lifetime_id)

    # -- EventSink -----------------------------------------------------------------------

    async def on_batch(self, received: ReceivedBatch) -> None:
        """Apply one delivered batch (see the module docstring for the recovery paths)."""
        worker = self._workers.get(received.worker_id)
        if worker is None:
            self.metrics.batches.labels(received.worker_id, "unknown_worker").inc()
            return
        async with worker.changing():
            outer = not worker.in_batch
            worker.in_batch = True
            try:
                await worker.apply_batch(received)
            except RECOVERY_ERRORS as exc:
                self._note_write_error(exc)
                worker.recovery.failed(exc)
                self.metrics.batches.labels(worker.worker_id, "failed").inc()
            except Exception as exc:  # a bug: the worker's stream must outlive it
                log.exception("worker %s: applying seq %d failed", received.worker_id,
                              received.seq)  # fmt: skip
                worker.recovery.failed(exc)
                self.metrics.batches.labels(worker.worker_id, "failed").inc()
            finally:
                if outer:
                    worker.in_batch = False

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
        """The worker's publisher restarted: its cache is new, drop its entries."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        async with worker.changing():
            if worker.note_restart(seq) or worker.lease is None:
                return  # in order with the batches kept for a handoff, or not ours
            self.metrics.resets.labels(worker_id).inc()
            try:
                await worker.recovery.clear(applied_through=-1)
            except RECOVERY_ERRORS as exc:
                worker.recovery.failed(exc)
            await worker.recovery.record_lifetime()

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
        """Batches were lost for good: clear the worker and rebuild what can be."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        async with worker.changing():
            if worker.lease is None:
                return
            try:
                await worker.recovery.resync(reason)
            except RECOVERY_ERRORS as exc:
                worker.recovery.failed(exc)

    async def _restart_probe(self, worker_id: WorkerId) -> bool:
        """The subscriber's restart probe of a worker's stream (see ``WorkerStream``)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.lease is None:
            return False  # nothing of it to keep or drop here
        return await self._tracker.changed(worker.record)

    def _write_failed(self, worker_id: WorkerId, exc: Exception) -> None:
        self._note_write_error(exc)
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.recovery.failed(exc)

    # -- background ----------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """One maintenance pass (see
        :meth:`router.ingest.maintenance.IngestMaintenance.maintain_once`)."""
        await self._maintenance.maintain_once()

    async def _check_idle(self) -> None:
        """The idle watchdog's round over the workers ingested (see its module)."""
        assert self._watchdog is not None
        self._watchdog.check(w for w in list(self._workers.values()) if self._is_current(w))

    async def _subscribe(self, record: WorkerRecord) -> WorkerIngest:
        """Subscribe to ``record``'s stream; on failure nothing of it is kept.

        Raises:
            CapacityError: This process cannot take another worker (nothing was opened).
            events.errors.EventsError: The subscription could not be set up.
        """
        assert self._subscriber is not None and self._services is not None
        assert self._capacity is not None
        self._capacity.check(len(self._workers) + 1)
        worker = self._workers[record.worker_id] = WorkerIngest(record, self._services)
        try:
            await self._subscriber.add_worker(
                WorkerStream(
                    worker_id=record.worker_id,
                    endpoint=record.events_endpoint,
                    replay_endpoint=record.replay_endpoint,
                    topic=record.topic.encode(),
                    curve=None
                    if record.server_key is None
                    else CurveClientConfig(record.server_key.encode(), self.config.client_keys),
                    restart_probe=functools.partial(self._restart_probe, record.worker_id)
                    if self._tracker.can_tell(record)
                    else None,
                )
            )
        except BaseException:
            del self._workers[record.worker_id]
            raise
        return worker

    # -- helpers -------------------------------------------------------------------------

    def _note_write_error(self, exc: Exception) -> None:
        self._maintenance.note_write_error(exc)

    def _is_current(self, worker: WorkerIngest) -> bool:
        """Whether ``worker`` is still the one ingested under its id."""
        return self._workers.get(worker.record.worker_id) is worker

    def _stream_counters(self) -> dict[WorkerId, WorkerCounters]:
        subscriber = self._subscriber
        if subscriber is None:
            return {}
        return {w: subscriber.counters(w) for w in subscriber.worker_ids}

    @property
    def _tracker(self) -> LifetimeTracker:
        assert self._lifetimes is not None, "start() first"
        return self._lifetimes
