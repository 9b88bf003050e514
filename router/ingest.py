"""Event ingest: folds every registered worker's KV event stream into the Redis prefix index.

:class:`IndexIngest` is the :class:`events.subscriber.EventSink` of one
:class:`events.subscriber.EventSubscriber` over all registered workers. Per worker:

* it writes only while it holds the worker's lease (renewed every third of its TTL);
  on acquiring one it resumes from the previous holder's handoff, or drops the worker's
  old entries and rebuilds them: from ``GET /v1/snapshot`` for kvroute workers, by replay
  from seq 0 for others;
* each batch is one fenced Redis script call, or shares one with the batches that arrive
  while the previous write is in flight (group commit); a batch already covered (by a
  snapshot or an earlier delivery) is skipped by seq;
* a ``BlockStored`` with an unknown parent is counted and triggers a replay from seq 0
  (entries cleared first); if replay cannot help, a resync: clear, then the snapshot
  (kvroute workers) or tolerant mode (others: orphans are stored detached, counted,
  never indexed);
* a publisher restart clears the worker. A restart shows as a seq drop; for kvroute
  workers also as a change of the lifetime id in ``GET /health`` (:mod:`router.lifetime`),
  checked on every seq jump before it is replayed as a gap, so a restart whose first
  batches were lost is not taken for a gap (vLLM engines have no such id: a jump is a gap);
* a lost lease or a Redis failure (e.g. Redis restarted empty) marks the worker for a
  rebuild, which the maintenance pass or the next batch performs.

Router replicas share the ingest (:mod:`router.ownership`: which replica holds which
worker's lease, and how leases move with the previous holder's state of the worker). A
router keeps the batches (and publisher restarts) it receives for a worker it owns but
does not hold yet, so the ones published while the lease moves are applied too, even from
a vLLM engine without a replay endpoint; it subscribes before its first heartbeat
announces it, so they reach it.

Registrations persist in Redis (:class:`router.index.registry.WorkerRegistry`), so a
restarted router resumes the same workers; a maintenance pass also reaps workers whose
lease lapsed (their router died).

This module holds the membership, the event sink and the maintenance pass; the leases are
a :class:`router.ownership.LeaseKeeper`, each worker's batch and recovery paths a
:class:`router.worker_ingest.WorkerIngest`, and which rebuild follows which loss is
decided by :mod:`router.recovery` (shared with the offline replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from redis.exceptions import RedisError

from events.curve import CurveClientConfig, CurveKeyPair
from events.subscriber import (
    EventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    WorkerCounters,
    WorkerStream,
)
from router.index.base import WorkerId
from router.index.redis_index import RedisPrefixIndex
from router.index.registry import WorkerRecord, WorkerRegistry
from router.lifetime import LifetimeTracker
from router.metrics import IngestMetrics, StreamCollector
from router.ownership import RECOVERY_ERRORS, LeaseKeeper
from router.periodic import Periodic
from router.worker_ingest import IngestServices, WorkerIngest

__all__ = ["IndexIngest", "IngestConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """Settings of :class:`IndexIngest`.

    Attributes:
        maintain_interval_s: Period of the maintenance pass (lease renewal, takeover of
            lapsed workers, reaping, registry sync); keep it at most a third of the
            registry's lease TTL.
        snapshot_timeout_s: Timeout of one ``GET /v1/snapshot``.
        lifetime_timeout_s: Timeout of one ``GET /health`` that reads a kvroute worker's
            lifetime id (a seq jump waits for it; no answer: the jump is a gap).
        snapshot_chunk_runs: Snapshot runs written per index batch.
        group_commit: Turn on the index's group commit: a batch returns once folded, and
            a worker's batches that arrive while its previous write is in flight go to
            Redis together (see :mod:`router.index.group_commit`).
        subscriber: Settings of the event subscriber.
        client_keys: The router's CURVE key pair, presented to workers registered with a
            ``server_key`` (a fresh one by default: admitted by workers without an allow-list).
    """

    maintain_interval_s: float = 3.0
    snapshot_timeout_s: float = 10.0
    lifetime_timeout_s: float = 2.0
    snapshot_chunk_runs: int = 512
    group_commit: bool = True
    subscriber: SubscriberConfig = field(default_factory=SubscriberConfig)
    client_keys: CurveKeyPair = field(default_factory=CurveKeyPair.generate)


class IndexIngest:
    """Folds registered workers' event streams into a Redis prefix index (an ``EventSink``).

    Args:
        index: The Redis prefix index it writes.
        registry: Registrations and leases of the same namespace.
        config: Periods, timeouts and subscriber settings.
        metrics: Where counters go (a private registry by default).
    """

    def __init__(
        self,
        index: RedisPrefixIndex,
        registry: WorkerRegistry,
        config: IngestConfig | None = None,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.config = config or IngestConfig()
        index.group_commit = self.config.group_commit
        index.on_write_error(self._write_failed)
        self.metrics = metrics or IngestMetrics()
        self._workers: dict[str, WorkerIngest] = {}
        # NOTE: held while the set of workers changes (add, remove, the maintenance's
        # registry sync), so a removal is never undone by a sync that read the registry
        # before the registration was deleted.
        self._membership = asyncio.Lock()
        self._subscriber: EventSubscriber | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lifetimes: LifetimeTracker | None = None
        self._services: IngestServices | None = None
        self._maintainer = Periodic(self.maintain_once, self.config.maintain_interval_s)
        self._leases = LeaseKeeper(index, registry, self.metrics)
        self._writable = True
        self._write_errors = 0
        self._write_errors_seen = 0  # as of the end of the last maintenance pass

    @property
    def index_writable(self) -> bool:
        """Whether Redis takes this router's index writes.

        False from the moment a write fails on a Redis error (Redis refused it, e.g. out
        of memory or read-only, or did not answer), until a maintenance pass (its
        heartbeat is a write too) completes with no write failed since the previous
        pass. A lost lease is no such failure.
        """
        return self._writable

    @property
    def owned_workers(self) -> list[WorkerId]:
        """Workers whose lease this router holds, sorted."""
        return sorted(w.worker_id for w in self._workers.values() if w.lease is not None)

    async def start(self, records: Sequence[WorkerRecord] = ()) -> None:
        """Register ``records``, subscribe to every registered worker, start maintenance."""
        self._session = aiohttp.ClientSession()
        self._lifetimes = LifetimeTracker(self._session, self.config.lifetime_timeout_s)
        self._subscriber = EventSubscriber(self, self.config.subscriber)
        self._services = IngestServices(
            index=self.index,
            metrics=self.metrics,
            subscriber=self._subscriber,
            session=self._session,
            lifetimes=self._lifetimes,
            snapshot_timeout_s=self.config.snapshot_timeout_s,
            snapshot_chunk_runs=self.config.snapshot_chunk_runs,
        )
        self.metrics.registry.register(StreamCollector(self._stream_counters))
        for record in records:
            await self.registry.register(record)
        # Subscribe before the first heartbeat announces this router: the others hand
        # it their workers from then on, and what they publish meanwhile must arrive.
        async with self._membership:
            await self._sync_registry()
        await self.maintain_once()
        self._maintainer.start("kvroute-ingest", wait_first=True)

    async def close(self) -> None:
        """Stop maintenance and the subscriber; hand every held lease on (entries stay).

        Each worker goes, with this router's state of it, to its owner among the other
        live routers, or is parked for whichever router starts next when none is left
        (so a restarted router resumes it without a rebuild).
        """
        await self._maintainer.stop()
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

    async def add_worker(self, record: WorkerRecord) -> None:
        """Register a worker (persisted) and start ingesting it.

        Idempotent: a worker already ingested with the same record is only registered
        again (and its lease taken if this router holds none); one with a different
        record is unsubscribed first.
        """
        async with self._membership:
            await self.registry.register(record)
            worker = self._workers.get(record.worker_id)
            if worker is not None and worker.record != record:
                await self._unsubscribe(worker)
                worker = None
            if worker is None:
                await self._subscribe(record)
                worker = self._workers[record.worker_id]
        if worker.lease is None and self._leases.owns(worker.worker_id):
            await self._leases.take_over(worker, functools.partial(self._is_current, worker))

    async def remove_worker(self, worker_id: WorkerId) -> None:
        """Stop ingesting a worker, drop its entries and its registration."""
        async with self._membership:
            worker = self._workers.get(worker_id)
            if worker is not None:
                await self._unsubscribe(worker)
            await self.registry.unregister(worker_id)

    async def _unsubscribe(self, worker: WorkerIngest) -> None:
        """Stop reading ``worker``'s stream, drop its entries and release its lease."""
        wid = worker.worker_id
        del self._workers[wid]
        if self._subscriber is not None:
            await self._subscriber.remove_worker(wid)
        if self._lifetimes is not None:
            self._lifetimes.forget(wid)
        async with worker.lock.hold():  # waits for a maintenance step in flight
            if worker.lease is not None:
                await self.index.clear_worker(wid)
                self.index.forget_lease(wid)
                await self.registry.release(worker.lease)
                worker.lease = None

    # -- EventSink -----------------------------------------------------------------------

    async def on_batch(self, received: ReceivedBatch) -> None:
        """Apply one delivered batch (see the module docstring for the recovery paths)."""
        worker = self._workers.get(received.worker_id)
        if worker is None:
            self.metrics.batches.labels(received.worker_id, "unknown_worker").inc()
            return
        async with worker.lock.hold():
            outer = not worker.in_batch
            worker.in_batch = True
            try:
                await worker.apply_batch(received)
            except RECOVERY_ERRORS as exc:
                self._note_write_error(exc)
                worker.failed(exc)
                self.metrics.batches.labels(worker.worker_id, "failed").inc()
            except Exception as exc:  # a bug: the worker's stream must outlive it
                log.exception("worker %s: applying seq %d failed", received.worker_id,
                              received.seq)  # fmt: skip
                worker.failed(exc)
                self.metrics.batches.labels(worker.worker_id, "failed").inc()
            finally:
                if outer:
                    worker.in_batch = False

    async def on_reset(self, worker_id: str, seq: int) -> None:
        """The worker's publisher restarted: its cache is new, drop its entries."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        async with worker.lock.hold():
            if worker.note_restart(seq) or worker.lease is None:
                return  # in order with the batches kept for a handoff, or not ours
            self.metrics.resets.labels(worker_id).inc()
            try:
                await worker.clear(applied_through=-1)
            except RECOVERY_ERRORS as exc:
                worker.failed(exc)
            await self._tracker.record(worker.record)

    async def on_resync_needed(self, worker_id: str, reason: str) -> None:
        """Batches were lost for good: clear the worker and rebuild what can be."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        async with worker.lock.hold():
            if worker.lease is None:
                return
            try:
                await worker.resync(reason)
            except RECOVERY_ERRORS as exc:
                worker.failed(exc)

    async def _restart_probe(self, worker_id: str) -> bool:
        """The subscriber's restart probe of a kvroute worker's stream (see ``WorkerStream``)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.lease is None:
            return False  # nothing of it to keep or drop here
        return await self._tracker.changed(worker.record)

    def _write_failed(self, worker_id: WorkerId, exc: Exception) -> None:
        self._note_write_error(exc)
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.failed(exc)

    # -- maintenance ---------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync registrations, renew or take leases, rebuild what needs it, reap lapsed workers.

        Redis errors are logged and counted; the next pass retries.
        """
        try:
            await self._leases.heartbeat()
            for worker in self._workers.values():
                # A worker this router owns but does not hold is being handed to it (or
                # will be taken): keep its batches from now on, as the lease may come with
                # the previous holder's state, which they continue.
                if worker.lease is None:
                    worker.keep_batches(self._leases.owns(worker.worker_id))
            async with self._membership:
                await self._sync_registry()
            for worker in list(self._workers.values()):
                if self._is_current(worker):  # not removed since this pass listed it
                    await self._leases.maintain(worker, functools.partial(self._is_current, worker))
            reaped = await self.registry.reap(self.index)
            self.metrics.reaped.inc(len(reaped))
            self._writable = self._write_errors == self._write_errors_seen
        except RedisError as exc:
            self._writable = False
            log.warning("ingest maintenance: Redis error (%s); retrying next pass", exc)
        self._write_errors_seen = self._write_errors
        self.metrics.owned.set(len(self.owned_workers))

    async def _sync_registry(self) -> None:
        """Persist this router's workers again and subscribe to new registrations."""
        persisted = {r.worker_id: r for r in await self.registry.records()}
        for worker in list(self._workers.values()):
            if worker.record.worker_id not in persisted:
                # Redis lost its data (or another replica unregistered the worker
                # without us knowing): persist it again.
                await self.registry.register(worker.record)
        for record in persisted.values():
            if record.worker_id not in self._workers:
                await self._subscribe(record)

    async def _subscribe(self, record: WorkerRecord) -> None:
        assert self._subscriber is not None and self._services is not None
        self._workers[record.worker_id] = WorkerIngest(record, self._services)
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
                if record.has_snapshot
                else None,
            )
        )

    # -- helpers -------------------------------------------------------------------------

    def _note_write_error(self, exc: Exception) -> None:
        if isinstance(exc, RedisError):
            self._writable = False
            self._write_errors += 1

    def _is_current(self, worker: WorkerIngest) -> bool:
        """Whether ``worker`` is still the one ingested under its id."""
        return self._workers.get(worker.record.worker_id) is worker

    def _stream_counters(self) -> dict[str, WorkerCounters]:
        subscriber = self._subscriber
        if subscriber is None:
            return {}
        return {w: subscriber.counters(w) for w in subscriber.worker_ids}

    @property
    def _tracker(self) -> LifetimeTracker:
        assert self._lifetimes is not None, "start() first"
        return self._lifetimes
