"""Event ingest: folds every registered worker's KV event stream into the Redis prefix index.

:class:`IndexIngest` is the :class:`events.subscriber.EventSink` of one
:class:`events.subscriber.EventSubscriber` over all registered workers. Per worker:

* it writes only while it holds the worker's lease (renewed every third of its TTL);
  on acquiring one it drops the worker's old entries and rebuilds them: from
  ``GET /v1/snapshot`` for kvroute workers, by replay from seq 0 for others;
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

Registrations persist in Redis (:class:`router.index.registry.WorkerRegistry`), so a
restarted router resumes the same workers; a maintenance pass also reaps workers whose
lease lapsed (their router died).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import aiohttp
from redis.exceptions import RedisError

from events.curve import CurveClientConfig, CurveKeyPair
from events.schema import KVEventBatch
from events.subscriber import (
    EventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    WorkerCounters,
    WorkerStream,
)
from router.errors import OrphanParentError, PrefixIndexError
from router.index.base import WorkerId
from router.index.bridge import BridgeCounters
from router.index.redis_index import RedisPrefixIndex
from router.index.registry import Lease, WorkerRecord, WorkerRegistry
from router.index.scripts import StaleLeaseError
from router.index.snapshot import fetch_snapshot, snapshot_events
from router.lifetime import LifetimeTracker
from router.metrics import IngestMetrics, StreamCollector
from router.task_lock import TaskLock

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


@dataclass(eq=False)
class _Worker:
    record: WorkerRecord
    lease: Lease | None = None
    # NOTE: applied_through is the highest seq whose effect the index holds (-1: none
    # since the last clear; None: unknown, accept the next batch whatever its seq).
    applied_through: int | None = -1
    needs_rebuild: bool = False
    replaying: bool = False
    in_batch: bool = False
    # NOTE: held by whatever changes the worker's entries (see TaskLock).
    lock: TaskLock = field(default_factory=TaskLock)
    seen: BridgeCounters = field(default_factory=BridgeCounters)

    @property
    def worker_id(self) -> WorkerId:
        return WorkerId(self.record.worker_id)


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
        self._workers: dict[str, _Worker] = {}
        # NOTE: held while the set of workers changes (add, remove, the maintenance's
        # registry sync), so a removal is never undone by a sync that read the registry
        # before the registration was deleted.
        self._membership = asyncio.Lock()
        self._subscriber: EventSubscriber | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lifetimes: LifetimeTracker | None = None
        self._maintainer: asyncio.Task[None] | None = None

    @property
    def owned_workers(self) -> list[WorkerId]:
        """Workers whose lease this router holds, sorted."""
        return sorted(w.worker_id for w in self._workers.values() if w.lease is not None)

    async def start(self, records: Sequence[WorkerRecord] = ()) -> None:
        """Register ``records``, subscribe to every registered worker, start maintenance."""
        self._session = aiohttp.ClientSession()
        self._lifetimes = LifetimeTracker(self._session, self.config.lifetime_timeout_s)
        self._subscriber = EventSubscriber(self, self.config.subscriber)
        self.metrics.registry.register(StreamCollector(self._stream_counters))
        for record in records:
            await self.registry.register(record)
        await self.maintain_once()
        self._maintainer = asyncio.create_task(self._maintain_forever(), name="kvroute-ingest")

    async def close(self) -> None:
        """Stop maintenance and the subscriber and release held leases (entries stay)."""
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        if self._subscriber is not None:
            await self._subscriber.close()
        with contextlib.suppress(RedisError, PrefixIndexError):
            await self.index.flush()
        await self.index.close()
        for worker in self._workers.values():
            if worker.lease is not None:
                with contextlib.suppress(RedisError):
                    await self.registry.release(worker.lease)
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
        if worker.lease is None:
            await self._take_over(worker)

    async def remove_worker(self, worker_id: WorkerId) -> None:
        """Stop ingesting a worker, drop its entries and its registration."""
        async with self._membership:
            worker = self._workers.get(worker_id)
            if worker is not None:
                await self._unsubscribe(worker)
            await self.registry.unregister(worker_id)

    async def _unsubscribe(self, worker: _Worker) -> None:
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
                await self._on_batch(worker, received)
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                self._failed(worker, exc)
                self.metrics.batches.labels(worker.worker_id, "failed").inc()
            finally:
                if outer:
                    worker.in_batch = False

    async def on_reset(self, worker_id: str, seq: int) -> None:
        """The worker's publisher restarted: its cache is new, drop its entries."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        self.metrics.resets.labels(worker_id).inc()
        async with worker.lock.hold():
            if worker.lease is None:
                return
            try:
                await self._clear(worker, applied_through=-1)
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                self._failed(worker, exc)
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
                await self._resync(worker, reason)
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                self._failed(worker, exc)

    # -- batch path ----------------------------------------------------------------------

    async def _on_batch(self, worker: _Worker, received: ReceivedBatch) -> None:
        wid = worker.worker_id
        if worker.lease is None:
            self.metrics.batches.labels(wid, "not_owner").inc()
            return
        if worker.needs_rebuild:
            await self._rebuild(worker)
        applied = worker.applied_through
        if applied is not None and received.seq > applied + 1 and not worker.replaying:
            if await self._tracker.changed(worker.record):
                await self._reset_lifetime(worker, received.seq)
            else:
                # Batches before this one never reached the index (a late join, a
                # snapshot older than the stream): fetch them; the replay redelivers
                # this one too.
                await self._replay(worker, applied + 1, clear=False)
        if self._covered(worker, received):
            return
        try:
            await self.index.apply(wid, received.batch)
        except OrphanParentError as exc:
            self.metrics.orphans.labels(wid).inc()
            self._sync_counters(worker)
            if worker.replaying or worker.record.replay_endpoint is None:
                log.warning("%s; resyncing worker %s", exc, wid)
                await self._resync(worker, "orphan_parent")
            else:
                log.warning("%s; replaying worker %s from seq 0", exc, wid)
                await self._replay(worker, 0, clear=True)
            if self._covered(worker, received):
                return
            # Rebuilt without this batch (tolerant mode now, or a snapshot older than
            # it): apply it once more; an orphan left now is claimed by nobody (safe).
            try:
                await self.index.apply(wid, received.batch)
            except OrphanParentError:
                self.metrics.orphans.labels(wid).inc()
        self._applied(worker, received)

    def _covered(self, worker: _Worker, received: ReceivedBatch) -> bool:
        """True (and counted) when the index already holds the batch's effect."""
        applied = worker.applied_through
        if applied is None or received.seq > applied:
            return False
        self.metrics.batches.labels(worker.worker_id, "covered").inc()
        return True

    def _applied(self, worker: _Worker, received: ReceivedBatch) -> None:
        wid = worker.worker_id
        worker.applied_through = received.seq
        self.metrics.batches.labels(wid, "applied").inc()
        types = Counter(type(e).__name__ for e in received.batch.events)
        for name, count in types.items():
            self.metrics.events.labels(wid, name).inc(count)
        self._sync_counters(worker)

    def _sync_counters(self, worker: _Worker) -> None:
        now = self.index.bridge(worker.worker_id).counters
        before = worker.seen
        for reason in ("malformed", "unknown_removals", "detached", "ignored_groups"):
            delta = getattr(now, reason) - getattr(before, reason)
            if delta > 0:
                self.metrics.skipped.labels(worker.worker_id, reason).inc(delta)
        worker.seen = replace(now)

    # -- recovery ------------------------------------------------------------------------

    async def _replay(self, worker: _Worker, from_seq: int, *, clear: bool) -> None:
        """Ask the subscriber for batches from ``from_seq`` (they come back to on_batch)."""
        assert self._subscriber is not None
        if clear:
            await self._clear(worker, applied_through=-1)
        worker.replaying = True
        try:
            ok = await self._subscriber.request_replay(worker.record.worker_id, from_seq)
        finally:
            worker.replaying = False
        self.metrics.replays.labels(worker.worker_id, "ok" if ok else "failed").inc()
        # On failure the subscriber has already called on_resync_needed.

    async def _resync(self, worker: _Worker, reason: str) -> None:
        """Clear the worker and rebuild from its snapshot, or accept the loss."""
        self.metrics.resyncs.labels(worker.worker_id, reason).inc()
        log.warning("worker %s: resync (%s)", worker.worker_id, reason)
        await self._reload(worker)

    async def _reset_lifetime(self, worker: _Worker, seq: int) -> None:
        """A kvroute worker restarted and its new lifetime's first batches were lost."""
        self.metrics.resets.labels(worker.worker_id).inc()
        log.warning(
            "worker %s: seq %d under a new publisher lifetime: it restarted; "
            "resetting it from its snapshot",
            worker.worker_id,
            seq,
        )
        await self._reload(worker)

    async def _reload(self, worker: _Worker) -> None:
        """Clear the worker, then load its snapshot or keep what arrives from now on."""
        await self._clear(worker, applied_through=None)
        if worker.record.has_snapshot:
            await self._load_snapshot(worker)
        else:
            # History is gone: keep what arrives from now on, orphans detached.
            self.index.bridge(worker.worker_id).tolerate_orphans = True

    async def _rebuild(self, worker: _Worker) -> None:
        """After a lease (re)acquisition or a failure: rebuild the worker from scratch."""
        worker.needs_rebuild = False
        if worker.record.has_snapshot:
            await self._resync(worker, "rebuild")
        elif worker.record.replay_endpoint is not None and worker.in_batch:
            await self._replay(worker, 0, clear=True)
        else:
            await self._resync(worker, "rebuild")

    async def _clear(self, worker: _Worker, applied_through: int | None) -> None:
        await self.index.clear_worker(worker.worker_id)
        self.index.bridge(worker.worker_id).tolerate_orphans = False
        worker.applied_through = applied_through

    async def _load_snapshot(self, worker: _Worker) -> None:
        wid, record = worker.worker_id, worker.record
        assert self._session is not None and record.http_url is not None
        bridge = self.index.bridge(wid)
        await self._tracker.record(record)  # before: never newer than the snapshot's
        try:
            snapshot = await fetch_snapshot(
                self._session, record.http_url, self.config.snapshot_timeout_s
            )
        except PrefixIndexError as exc:
            self.metrics.snapshots.labels(wid, "failed").inc()
            log.error("worker %s: %s; keeping only what arrives from now on", wid, exc)
            bridge.tolerate_orphans = True
            return
        events = snapshot_events(snapshot)
        bridge.tolerate_orphans = True  # runs under an evicted ancestor are unreachable
        try:
            step = self.config.snapshot_chunk_runs
            for start in range(0, len(events), step):
                batch = KVEventBatch(ts=time.time(), events=list(events[start : start + step]))
                await self.index.apply(wid, batch)
        finally:
            bridge.tolerate_orphans = False
        await self.index.flush(wid)  # the snapshot is in Redis before the stream resumes
        worker.applied_through = snapshot.next_seq - 1
        self.metrics.snapshots.labels(wid, "ok").inc()
        self._sync_counters(worker)
        log.info(
            "worker %s: loaded snapshot of %d runs (next seq %d)",
            wid,
            len(events),
            snapshot.next_seq,
        )

    async def _restart_probe(self, worker_id: str) -> bool:
        """The subscriber's restart probe of a kvroute worker's stream (see ``WorkerStream``)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.lease is None:
            return False  # nothing of it to keep or drop here
        return await self._tracker.changed(worker.record)

    def _write_failed(self, worker_id: WorkerId, exc: Exception) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._failed(worker, exc)

    def _failed(self, worker: _Worker, exc: Exception) -> None:
        wid = worker.worker_id
        if isinstance(exc, StaleLeaseError):
            self.metrics.lease_lost.labels(wid).inc()
            log.warning("worker %s: lost its lease (%s); maintenance will retake it", wid, exc)
            worker.lease = None
            self.index.forget_lease(wid)
        else:
            if isinstance(exc, RedisError):
                self.metrics.redis_errors.labels(wid).inc()
            log.warning("worker %s: index write failed (%s); it will be rebuilt", wid, exc)
        worker.needs_rebuild = True

    # -- maintenance ---------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync registrations, renew or take leases, rebuild what needs it, reap lapsed workers.

        Redis errors are logged and counted; the next pass retries.
        """
        try:
            async with self._membership:
                await self._sync_registry()
            for worker in list(self._workers.values()):
                await self._maintain_worker(worker)
            reaped = await self.registry.reap(self.index)
            self.metrics.reaped.inc(len(reaped))
        except RedisError as exc:
            log.warning("ingest maintenance: Redis error (%s); retrying next pass", exc)
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

    async def _maintain_worker(self, worker: _Worker) -> None:
        if self._workers.get(worker.record.worker_id) is not worker:
            return  # removed since this pass listed it
        # NOTE: the lease says which router ingests the worker, not that the worker is
        # alive: it is renewed while the worker is registered here, quiet or not (a SUB
        # socket cannot tell a quiet publisher from a dead one). The service drops a
        # worker it cannot reach (remove_worker), which releases the lease.
        if worker.lease is not None and not await self.registry.renew(worker.lease):
            self.metrics.lease_lost.labels(worker.worker_id).inc()
            log.warning("worker %s: lease lapsed or taken; retaking it", worker.worker_id)
            worker.lease = None
            self.index.forget_lease(worker.worker_id)
        if worker.lease is None:
            await self._take_over(worker)
            return
        async with worker.lock.hold():
            try:  # surfaces a failed queued write of an idle worker
                await self.index.flush(worker.worker_id)
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                self._failed(worker, exc)
            if worker.needs_rebuild and worker.record.has_snapshot:
                await self._guarded_rebuild(worker)

    async def _take_over(self, worker: _Worker) -> None:
        lease = await self.registry.acquire(worker.worker_id)
        if lease is None:
            return  # another router replica ingests this worker
        async with worker.lock.hold():
            if self._workers.get(worker.record.worker_id) is not worker:
                await self.registry.release(lease)  # removed while the lease was acquired
                return
            log.info("worker %s: lease acquired (epoch %d)", worker.worker_id, lease.epoch)
            worker.lease = lease
            self.index.use_lease(worker.worker_id, lease.token)
            worker.needs_rebuild = True
            # Snapshot workers are rebuilt now (also when idle); others at their next batch,
            # where a replay can be requested.
            if worker.record.has_snapshot:
                await self._guarded_rebuild(worker)
            else:
                await self._guarded_clear(worker)

    async def _guarded_rebuild(self, worker: _Worker) -> None:
        try:
            await self._rebuild(worker)
        except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
            self._failed(worker, exc)

    async def _guarded_clear(self, worker: _Worker) -> None:
        try:
            await self._clear(worker, applied_through=-1)
        except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
            self._failed(worker, exc)

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintain_interval_s)  # a period, not a sync
            await self.maintain_once()

    async def _subscribe(self, record: WorkerRecord) -> None:
        assert self._subscriber is not None
        self._workers[record.worker_id] = _Worker(record)
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

    def _stream_counters(self) -> dict[str, WorkerCounters]:
        subscriber = self._subscriber
        if subscriber is None:
            return {}
        return {w: subscriber.counters(w) for w in subscriber.worker_ids}

    @property
    def _tracker(self) -> LifetimeTracker:
        assert self._lifetimes is not None, "start() first"
        return self._lifetimes
