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

This module holds the membership, the event sink and the maintenance pass; the leases are
a :class:`router.ingest.ownership.LeaseKeeper`, each worker's batch and recovery paths a
:class:`router.ingest.worker.WorkerIngest`, and which rebuild follows which loss is
decided by :mod:`router.ingest.recovery` (shared with the offline replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
from redis.exceptions import RedisError

from events.auth import SentKey
from events.curve import CurveClientConfig, CurveKeyPair
from events.errors import EventsError
from events.identity import WorkerId
from events.rate_limited_log import RateLimitedLog
from events.subscriber import (
    EventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    WorkerCounters,
    WorkerStream,
)
from router.index.group_commit import GroupCommitIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.capacity import CapacityError, FleetCapacity, fd_limit
from router.ingest.lifetime_checks import LifetimeChecks
from router.ingest.metrics import IngestMetrics, StreamCollector
from router.ingest.ownership import RECOVERY_ERRORS, LeaseKeeper
from router.ingest.watchdog import DEFAULT_IDLE_CHECK_S, IdleWatchdog
from router.ingest.worker import IngestServices, WorkerIngest
from router.ingest.write_gate import WriteGate, shut_reason
from router.store.markers import DataMarkers
from router.tasks.periodic import Periodic
from router.workers.lifetime import LifetimeTracker
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry
from router.workers.registry_watch import RegistryWatch

__all__ = ["IndexIngest", "IngestConfig"]

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class IngestConfig:
    """Settings of :class:`IndexIngest`.

    Attributes:
        maintain_interval_s: Period of the lease renewal and of the maintenance pass
            (takeover of lapsed workers, rebuilds, reaping, registry sync, lifetime
            checks); keep it at most a third of the registry's lease TTL.
        snapshot_timeout_s: Timeout of one ``GET /v1/snapshot``.
        lifetime_timeout_s: Timeout of one request that reads a worker's lifetime
            (a seq jump waits for it; no answer: the jump is a gap).
        idle_check_s: A held worker's stream that delivered nothing for this long has
            its position checked (:mod:`router.ingest.watchdog`), and again after as
            long; 0 turns the checks off.
        write_retry_max_s: While Redis refuses writes for lack of memory, the longest
            wait between two probes of whether it takes them again.
        snapshot_chunk_runs: Snapshot runs written per index batch.
        group_commit: Wrap the index's store in group commit: a batch returns once
            folded, and a worker's batches that arrive while its previous write is in
            flight go to Redis together (see :mod:`router.index.group_commit`).
        subscriber: Settings of the event subscriber.
        client_keys: The router's CURVE key pair, presented to workers registered with a
            ``server_key`` (a fresh one by default: admitted by workers without an allow-list).
        worker_admin_key: The workers' admin key, sent with every request the ingest makes
            of a worker (its snapshot, its lifetime); None: no ``Authorization``.
    """

    maintain_interval_s: float = 3.0
    snapshot_timeout_s: float = 10.0
    lifetime_timeout_s: float = 2.0
    idle_check_s: float = DEFAULT_IDLE_CHECK_S
    write_retry_max_s: float = 10.0
    snapshot_chunk_runs: int = 512
    group_commit: bool = True
    subscriber: SubscriberConfig = field(default_factory=SubscriberConfig)
    client_keys: CurveKeyPair = field(default_factory=CurveKeyPair.generate)
    worker_admin_key: SentKey | None = None


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
        # NOTE: held while the set of workers changes (add, remove, the maintenance's
        # registry sync), so a removal is never undone by a sync that read the registry
        # before the registration was deleted.
        self._membership = asyncio.Lock()
        self._subscriber: EventSubscriber | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lifetimes: LifetimeTracker | None = None
        self._capacity: FleetCapacity | None = None
        self._markers = DataMarkers(registry.client, registry.layout, registry.owner)
        self._registry_watch = RegistryWatch(registry)
        self._lifetime_checks = LifetimeChecks(self.config.maintain_interval_s)
        self._services: IngestServices | None = None
        self._maintainer = Periodic(self.maintain_once, self.config.maintain_interval_s)
        self._renewer = Periodic(self.renew_leases, self.config.maintain_interval_s)
        self._watchdog: IdleWatchdog | None = None
        # The watchdog looks often; each worker is checked at most once per idle bound.
        self._watcher = Periodic(self._check_idle, min(1.0, self.config.idle_check_s / 4))
        self._renewed_at = float("-inf")
        self._gate = WriteGate(
            registry.client,
            self.metrics,
            retry_max_s=self.config.write_retry_max_s,
            log_interval_s=self.config.subscriber.log_interval_s,
        )
        self._leases = LeaseKeeper(index, registry, self.metrics, self._gate)
        self._warn = RateLimitedLog(self.config.subscriber.log_interval_s, log)
        # NOTE: _writable is False from a failed write until a maintenance pass completes
        # with no write failed since the pass before (the gate covers out-of-memory apart).
        self._writable = True
        self._write_errors = 0
        self._write_errors_seen = 0  # as of the end of the last maintenance pass

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
        return self._gate.is_open and self._writable

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
        await self._markers.write()
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
        async with self._membership:
            for record in records:  # the operator's flags and config replace saved ones
                await self._add(record, replace=True)
            await self._sync_registry()
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
        """Start ingesting a worker, then save its registration (persisted in Redis).

        The subscription comes first and the registration is saved last, so a saved
        registration always has a subscription behind it; if saving fails, the new
        subscription is undone and nothing of ``record`` remains (a registration it was
        to replace stays saved, and the next maintenance pass subscribes to it again).

        Args:
            record: The worker (already validated and admitted by the caller).
            replace: Replace a different registration saved under its id; without it,
                that is a conflict.

        Returns:
            ``"created"``, ``"replaced"``, or ``"unchanged"`` when the same registration
            was saved (then only its subscription and lease are ensured).

        Raises:
            RegistrationConflict: Another registration is saved and ``replace`` is False.
            redis.exceptions.RedisError: Redis failed; nothing was saved.
            events.errors.EventsError: The subscription could not be set up.
            router.ingest.capacity.CapacityError: This router holds as many workers as
                its file descriptors allow; nothing was saved.
        """
        async with self._membership:
            outcome, worker = await self._add(record, replace=replace)
        if worker.lease is None and self._leases.owns(worker.worker_id):
            await self._leases.take_over(worker, functools.partial(self._is_current, worker))
            await self._leases.settle(worker.worker_id)  # its snapshot is in
        return outcome

    async def _add(self, record: WorkerRecord, *, replace: bool) -> tuple[Outcome, WorkerIngest]:
        """:meth:`add_worker` without the lease; the caller holds the membership lock."""
        if not replace:
            await self.registry.check_free(record)  # before touching any subscription
        worker = self._workers.get(record.worker_id)
        if worker is not None and worker.record != record:
            await self._unsubscribe(worker)
            worker = None
        fresh = worker is None
        if worker is None:
            worker = await self._subscribe(record)
        try:
            outcome = await self.registry.save(record, replace=replace)
        except BaseException:
            if fresh:
                await self._unsubscribe(worker)
            raise
        return outcome, worker

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        """Stop ingesting a worker, drop its entries and its registration.

        Returns:
            Whether a registration was saved (usable or not) or the worker ingested.
        """
        async with self._membership:
            worker = self._workers.get(worker_id)
            if worker is not None:
                await self._unsubscribe(worker)
            saved = await self.registry.unregister(worker_id)
        return saved or worker is not None

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

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
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
            await worker.record_lifetime()

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
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
            worker.failed(exc)

    # -- maintenance ---------------------------------------------------------------------

    async def renew_leases(self) -> None:
        """Renew the held leases and this router's heartbeat (a task of its own: it waits
        on no worker's ingest). Redis errors are logged; the next round retries."""
        try:
            await self._leases.renew(self._workers.values())
            self._renewed_at = time.monotonic()
        except RedisError as exc:
            self._note_write_error(exc)  # renewals and heartbeats are writes
            self._redis_failed(exc, "lease renewal")

    async def maintain_once(self) -> None:
        """Renew leases (unless the renewal task keeps them renewed: then only this
        router's heartbeat), sync registrations, take or hand over leases, rebuild what
        needs it, publish block size flags, reap lapsed workers, check the workers'
        lifetimes.

        Redis errors are logged and counted; the next pass retries. A worker whose lock
        is busy (its ingest is at work) is skipped: no pass waits on one worker.
        """
        if time.monotonic() - self._renewed_at < 1.5 * self.config.maintain_interval_s:
            # The renewal task keeps the leases renewed: only learn the live routers now
            # (renewing here too would double the renewals); past 1.5 periods it is late.
            try:
                await self._leases.heartbeat()
            except RedisError as exc:
                self._note_write_error(exc)
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
            async with self._membership:
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
        self.metrics.owned.set(len(self.owned_workers))

    async def _check_idle(self) -> None:
        """The idle watchdog's round over the workers ingested (see its module)."""
        assert self._watchdog is not None
        self._watchdog.check(w for w in list(self._workers.values()) if self._is_current(w))
    async def _check_markers(self) -> None:
        """If a Redis node lost its data (:mod:`router.store.markers`), mark every worker
        whose entries this router holds, or held until the loss, for a restore from its
        bridge (done by this pass: the leases that went with the data are dropped now, so
        the pass takes them again), then set the markers again."""
        lost = await self._markers.lost()
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
        await self._markers.write()

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
            self._tracker, held, self._is_current, self._leases.run_apart
        )

    async def _sync_registry(self) -> None:
        """Persist this router's workers again and follow the saved registrations (when
        the registry changed: :class:`router.workers.registry_watch.RegistryWatch`).

        A registration saved by another router is subscribed to (one replaced there is
        resubscribed); one that is invalid, refused by this router's policy, or whose
        subscription cannot be set up is skipped and reported once by the registry.
        """
        changed = await self._registry_watch.changed()
        if changed is None:
            return  # nothing saved or removed since the last read
        persisted = {r.worker_id: r for r in changed}
        for worker in list(self._workers.values()):
            if worker.record.worker_id not in persisted:
                # Redis lost its data (or another replica unregistered the worker
                # without us knowing): persist it again, unless someone saved another.
                await self.registry.create(worker.record)
        for record in persisted.values():
            current = self._workers.get(record.worker_id)
            if current is not None and current.record != record:
                await self._unsubscribe(current)  # replaced through another router
                current = None
            if current is None:
                try:
                    await self._subscribe(record)
                except (EventsError, zmq.ZMQError, CapacityError) as exc:
                    encoded = msgspec.json.encode(record)
                    self.registry.skip_invalid(record.worker_id, encoded, str(exc))

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
        if isinstance(exc, RedisError):
            self._writable = False
            self._write_errors += 1

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
