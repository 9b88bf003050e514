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

Router replicas share the ingest: every maintenance pass renews this router's heartbeat,
and a worker is ingested by its owner among the live routers (rendezvous hashing,
:func:`router.index.registry.owner_of`). A router hands the lease of a worker it holds
but does not own to the owner, and takes a worker it does not own only when the owner
left it unclaimed for a whole lease TTL. A lease given up on purpose (a handover, a
shutdown) carries the router's state of the worker (:mod:`router.index.handoff`): the
next holder continues the stream where it stopped and the worker's entries stay; only a
lease that lapsed or was taken in between (a crashed router) means a rebuild. A router
keeps the batches (and publisher restarts) it receives for a worker it owns but does not
hold yet, so the ones published while the lease moves are applied too, even from a vLLM
engine without a replay endpoint; a router subscribes before its first heartbeat
announces it, so they reach it.

Registrations persist in Redis (:class:`router.index.registry.WorkerRegistry`), so a
restarted router resumes the same workers; a maintenance pass also reaps workers whose
lease lapsed (their router died).

This module holds the membership, the leases and the maintenance pass; each worker's batch
and recovery paths are a :class:`router.worker_ingest.WorkerIngest`, and which rebuild
follows which loss is decided by :mod:`router.recovery` (shared with the offline replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
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
from router.errors import PrefixIndexError
from router.index.base import WorkerId
from router.index.redis_index import RedisPrefixIndex
from router.index.registry import WorkerRecord, WorkerRegistry, owner_of
from router.index.scripts import StaleLeaseError
from router.lifetime import LifetimeTracker
from router.metrics import IngestMetrics, StreamCollector
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
        # NOTE: the live routers as of this router's last heartbeat (empty before the
        # first: then every worker counts as its own); per worker it does not own, when
        # it first found the lease free (cleared once anyone holds it).
        self._routers: list[str] = []
        self._unclaimed_since: dict[str, float] = {}

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
        others = [router for router in self._routers if router != self.registry.owner]
        with contextlib.suppress(RedisError):
            await self.registry.leave()  # the others own our workers from their next pass
        if self._subscriber is not None:
            await self._subscriber.close()
        for worker in self._workers.values():
            async with worker.lock.hold():
                with contextlib.suppress(RedisError):
                    await self._pass_on(worker, owner_of(worker.worker_id, others) or "")
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
        if worker.lease is None and self._owns(worker.worker_id):
            await self._take_over(worker)

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
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
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
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
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
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                worker.failed(exc)

    async def _restart_probe(self, worker_id: str) -> bool:
        """The subscriber's restart probe of a kvroute worker's stream (see ``WorkerStream``)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.lease is None:
            return False  # nothing of it to keep or drop here
        return await self._tracker.changed(worker.record)

    def _write_failed(self, worker_id: WorkerId, exc: Exception) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.failed(exc)

    # -- maintenance ---------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync registrations, renew or take leases, rebuild what needs it, reap lapsed workers.

        Redis errors are logged and counted; the next pass retries.
        """
        try:
            self._routers = await self.registry.heartbeat()
            for worker in self._workers.values():
                # A worker this router owns but does not hold is being handed to it (or
                # will be taken): keep its batches from now on, as the lease may come with
                # the previous holder's state, which they continue.
                if worker.lease is None:
                    worker.keep_batches(self._owns(worker.worker_id))
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

    async def _maintain_worker(self, worker: WorkerIngest) -> None:
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
        owner = owner_of(worker.worker_id, self._routers)
        if worker.lease is not None and owner not in (None, self.registry.owner):
            await self._hand_over(worker, str(owner))
            return
        if worker.lease is None:
            if owner in (None, self.registry.owner) or await self._unclaimed(worker):
                await self._take_over(worker)
            return
        async with worker.lock.hold():
            try:  # surfaces a failed queued write of an idle worker
                await self.index.flush(worker.worker_id)
            except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
                worker.failed(exc)
            if worker.needs_rebuild and worker.record.has_snapshot:
                await self._guarded(worker, worker.rebuild)

    def _owns(self, worker_id: str) -> bool:
        return owner_of(worker_id, self._routers) in (None, self.registry.owner)

    async def _unclaimed(self, worker: WorkerIngest) -> bool:
        """True once the worker's lease has been free for a whole TTL (its owner is not
        taking it: stalled, or its ingest broken): then any router may."""
        wid = worker.worker_id
        if await self.registry.holder(WorkerId(wid)) is not None:
            self._unclaimed_since.pop(wid, None)
            return False
        since = self._unclaimed_since.setdefault(wid, time.monotonic())
        return time.monotonic() - since >= self.registry.lease_ttl_ms / 1000

    async def _hand_over(self, worker: WorkerIngest, owner: str) -> None:
        """Give the lease of a worker another live router owns to that router."""
        async with worker.lock.hold():
            if worker.lease is None:
                return
            await self._pass_on(worker, owner)
        self.metrics.handovers.labels(worker.worker_id).inc()
        log.info("worker %s: lease handed over to router %s (its owner)", worker.worker_id, owner)

    async def _pass_on(self, worker: WorkerIngest, next_owner: str) -> None:
        """Give up a held lease (callers hold the worker's lock): to ``next_owner`` with
        this router's state of the worker once its queued writes landed, or plainly when
        they did not (the next holder then rebuilds the worker)."""
        lease = worker.lease
        if lease is None:
            return
        try:
            await self.index.flush(worker.worker_id)  # its queued writes land first
            state = worker.handoff()
        except (RedisError, StaleLeaseError, PrefixIndexError):
            state = None
        worker.lease = None
        self.index.forget_lease(worker.worker_id)
        if state is None:
            await self.registry.release(lease)
        elif await self.registry.hand_off(lease, next_owner, state):
            self.metrics.handoffs.labels(worker.worker_id, "sent").inc()

    async def _take_over(self, worker: WorkerIngest) -> None:
        lease = await self.registry.acquire(worker.worker_id)
        if lease is None:
            return  # another router replica ingests this worker
        self._unclaimed_since.pop(worker.worker_id, None)
        async with worker.lock.hold():
            if self._workers.get(worker.record.worker_id) is not worker:
                await self.registry.release(lease)  # removed while the lease was acquired
                return
            log.info("worker %s: lease acquired (epoch %d)", worker.worker_id, lease.epoch)
            worker.lease = lease
            self.index.use_lease(worker.worker_id, lease.token)
            try:
                handed = await self.registry.take_handoff(worker.worker_id)
            except RedisError:
                handed = None  # rebuilt below (which meets the same Redis trouble)
            if worker.resume(lease, handed):
                await self._guarded(worker, worker.catch_up)
                return
            worker.needs_rebuild = True
            # Snapshot workers are rebuilt now (also when idle); others at their next batch,
            # where a replay can be requested.
            if worker.record.has_snapshot:
                await self._guarded(worker, worker.rebuild)
            else:
                await self._guarded(worker, functools.partial(worker.clear, applied_through=-1))

    async def _guarded(self, worker: WorkerIngest, step: Callable[[], Awaitable[None]]) -> None:
        """Run a step of ``worker``'s recovery; a failure marks it for a rebuild."""
        try:
            await step()
        except (RedisError, StaleLeaseError, PrefixIndexError) as exc:
            worker.failed(exc)

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

    def _stream_counters(self) -> dict[str, WorkerCounters]:
        subscriber = self._subscriber
        if subscriber is None:
            return {}
        return {w: subscriber.counters(w) for w in subscriber.worker_ids}

    @property
    def _tracker(self) -> LifetimeTracker:
        assert self._lifetimes is not None, "start() first"
        return self._lifetimes
