"""One worker's recovery paths: its entries handed over with the lease, restored, or rebuilt.

:class:`WorkerRecovery` is the collaborator of one :class:`router.ingest.worker.WorkerIngest`
(its :attr:`~router.ingest.worker.WorkerIngest.recovery`) that acts on that worker's state
when its entries cannot simply go on from the last batch: the lease moved (the state
handed to the next holder, or resumed from the previous one), the lease was lost, a write
failed, Redis lost its data (the entries written again from the bridge), batches were lost
for good, or the publisher restarted (the entries cleared, then its snapshot loaded, its
stream replayed, or what arrives from now on kept). Which rebuild follows which loss is
decided by :mod:`router.ingest.recovery`. Callers hold the worker's
:attr:`~router.ingest.worker.WorkerIngest.lock`; the network waits here set it down, as
the worker's module docstring says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from events.schema import KVEventBatch
from router.errors import PrefixIndexError
from router.ingest.handoff import HandoffError, decode_handoff, encode_handoff
from router.ingest.recovery import Rebuild
from router.ingest.write_gate import shut_reason
from router.store.scripts import StaleLeaseError
from router.workers.leases import Lease
from router.workers.snapshot import fetch_snapshot, snapshot_events

if TYPE_CHECKING:
    from router.ingest.worker import IngestServices, WorkerIngest

__all__ = ["WorkerRecovery"]

log = logging.getLogger(__name__)


class WorkerRecovery:
    """The recovery paths of one worker's ingest (callers hold the worker's lock).

    Args:
        worker: The worker's ingest, whose state is recovered.
        services: What all workers' ingests share.
    """

    def __init__(self, worker: WorkerIngest, services: IngestServices) -> None:
        self._worker = worker
        self._services = services

    # -- lease handoff -------------------------------------------------------------------

    async def handoff(self) -> bytes | None:
        """This router's state of the worker, for the next holder of its lease.

        ``None`` when the state is not known to match the worker's entries (a rebuild is
        pending, or a replay is being delivered); call it after the worker's queued writes
        landed. Encoded in a thread (a large worker's state takes a while, which the event
        loop need not wait on): the caller's hold on the worker's lock keeps the bridge
        still.
        """
        worker = self._worker
        if (
            worker.lease is None
            or worker.needs_rebuild
            or worker.position.replaying
            or worker.is_lock_set_down
        ):
            return None
        return await asyncio.to_thread(
            encode_handoff,
            self._services.index.bridge(worker.worker_id),
            worker.lease.epoch,
            worker.position.applied_through,
            worker.position.applied_ts,
            self._services.lifetimes.recorded(worker.worker_id),
        )

    async def resume(self, lease: Lease, data: bytes | None) -> bool:
        """Continue from the state the lease's previous holder handed over (``data``).

        True when it was taken: the bridge, the stream position and the lifetime id are
        the previous holder's, and the worker's entries stay as they are; the kept
        batches the previous holder did not apply (and restarts seen since) follow, from
        :meth:`router.ingest.worker.WorkerIngest.catch_up` or the next batch. False
        (counted and logged) when there was none, it is unreadable, or it is stale; then
        the caller rebuilds the worker.
        """
        wid, services = self._worker.worker_id, self._services
        if data is None:
            return False
        try:
            # In a thread: checking a large worker's state takes a while (about 2 µs per
            # block), which the event loop need not wait on; decoding builds new objects.
            handoff = await asyncio.to_thread(decode_handoff, data, services.index.keyer)
        except HandoffError as exc:
            services.metrics.handoffs.labels(wid, "invalid").inc()
            log.error("worker %s: %s; rebuilding it instead", wid, exc)
            return False
        if handoff.epoch + 1 != lease.epoch:
            services.metrics.handoffs.labels(wid, "stale").inc()
            log.warning(
                "worker %s: handoff of epoch %d is stale (lease epoch %d: it was held in "
                "between); rebuilding it instead",
                wid,
                handoff.epoch,
                lease.epoch,
            )
            return False
        services.index.adopt_bridge(wid, handoff.bridge)
        services.lifetimes.adopt(wid, handoff.lifetime_id)
        self._worker.resumed(handoff.applied_through, handoff.applied_ts)
        services.metrics.handoffs.labels(wid, "resumed").inc()
        log.info(
            "worker %s: resumed from the handed-over state (through seq %s); entries kept",
            wid,
            handoff.applied_through,
        )
        return True

    # -- losses --------------------------------------------------------------------------

    def lease_lost(self) -> None:
        """The lease lapsed or was refused (not given up): keep the batches delivered
        from now on, and the bridge for a restore unless a rebuild was pending anyway
        (see :attr:`router.ingest.worker.WorkerIngest.restorable`)."""
        worker = self._worker
        worker.lease = None
        worker.restorable = not worker.needs_rebuild
        self._services.index.forget_lease(worker.worker_id, keep_bridge=worker.restorable)
        worker.keep_batches(True)

    async def restore(self) -> None:
        """Redis lost the worker's entries (some or all) while this router held them: write
        them again from the bridge, which holds every batch applied, instead of
        rebuilding the worker from its events."""
        worker, services = self._worker, self._services
        wid = worker.worker_id
        written = await services.index.rewrite_worker(wid)
        worker.restorable = worker.restore_pending = worker.needs_rebuild = False
        services.metrics.restores.labels(wid).inc()
        log.warning("worker %s: Redis lost its entries; wrote its %d entries again", wid, written)

    async def resync(self, reason: str) -> None:
        """Batches were lost for good: clear the worker and rebuild what can be (later,
        when a network wait of its ingest is in progress: marked for a rebuild)."""
        if self._worker.is_lock_set_down:
            self._worker.needs_rebuild = True
            return
        await self.rebuild_as(self._worker.rules.after_loss(), reason)

    async def record_lifetime(self) -> None:
        """Record the lifetime id the worker reports now (read with the lock set down)."""
        worker, lifetimes = self._worker, self._services.lifetimes
        lifetimes.adopt(worker.worker_id, await worker.unlocked(lifetimes.current(worker.record)))

    async def rebuild(self, *, is_first_lease: bool = False) -> None:
        """After a lease (re)acquisition or a failure: rebuild the worker from scratch.

        Args:
            is_first_lease: The worker's first lease ever (epoch 1): nothing was indexed
                before, so nothing was lost and the rebuild is an ordinary start (logged
                at INFO; a rebuild after a loss is a WARNING).
        """
        worker = self._worker
        worker.needs_rebuild = False
        how = worker.rules.after_takeover(in_batch=worker.in_batch)
        await self.rebuild_as(how, "rebuild", is_loss=not is_first_lease)

    async def clear(self, applied_through: int | None) -> None:
        """Drop the worker's entries; the stream continues after ``applied_through``."""
        worker = self._worker
        worker.restorable = worker.restore_pending = False
        index = self._services.index
        await index.clear_worker(worker.worker_id)
        index.bridge(worker.worker_id).tolerate_orphans = False
        worker.position.applied_through = applied_through
        worker.position.applied_ts = None

    def failed(self, exc: Exception) -> None:
        """A write failed (``exc``): drop a lost lease, rebuild the worker later (once the
        index takes writes again, when Redis is out of memory or unreachable: the write
        gate then drops every worker's batches until it answers)."""
        worker, metrics = self._worker, self._services.metrics
        wid = worker.worker_id
        if isinstance(exc, StaleLeaseError):
            metrics.lease_lost.labels(wid).inc()
            log.warning("worker %s: lost its lease (%s); maintenance will retake it", wid, exc)
            self.lease_lost()
        else:
            # A write that failed on a Redis error may be followed by batches that meet
            # the same trouble: this worker is rebuilt, not restored from its bridge.
            worker.restorable = False
            if isinstance(exc, RedisError):
                metrics.redis_errors.labels(wid).inc()
            if shut_reason(exc) is not None:
                self._services.gate.refused(exc, f"worker {wid}")  # says so once per interval
            else:
                log.warning("worker %s: index write failed (%s); it will be rebuilt", wid, exc)
        worker.needs_rebuild = True

    # -- publisher restarts --------------------------------------------------------------

    async def check_lifetime(self, current: str | None) -> None:
        """The periodic check: ``current`` is the lifetime id the worker reports now (read
        without the lock); a new one means it restarted unseen (its new lifetime's first
        batches lost, and the rest continuous or not sent yet), so it is reset."""
        worker, lifetimes = self._worker, self._services.lifetimes
        if worker.lease is None or current is None or worker.position.replaying:
            return
        recorded = lifetimes.recorded(worker.worker_id)
        if recorded is None:
            lifetimes.adopt(worker.worker_id, current)
        elif recorded != current:
            await self.reset_lifetime(
                "found by the periodic check", in_batch=False, current=current
            )

    async def restarted_unseen(self, seq: int) -> None:
        """The publisher restarted while another router held the lease (a seq drop seen
        meanwhile, or a batch that reuses a seq the index holds, stamped later): the
        worker's entries are of the old lifetime."""
        self._services.metrics.resets.labels(self._worker.worker_id).inc()
        log.warning(
            "worker %s: its publisher restarted (at seq %d) while the lease moved; clearing it",
            self._worker.worker_id,
            seq,
        )
        await self.clear(applied_through=-1)
        await self.record_lifetime()

    async def reset_lifetime(
        self, when: str, *, in_batch: bool, current: str | None = None
    ) -> None:
        """The worker restarted and its new lifetime's first batches were lost (or
        reached another router): clear it and rebuild it from the new lifetime.

        Args:
            when: Where the new lifetime was seen (for the log).
            in_batch: Called from the subscriber's delivery (a replay may be asked for).
            current: The new lifetime id when already read (else it is read now).
        """
        worker, lifetimes = self._worker, self._services.lifetimes
        wid = worker.worker_id
        how = worker.rules.after_restart()
        worker.restart_ahead_of_stream = not in_batch
        self._services.metrics.resets.labels(wid).inc()
        log.warning(
            "worker %s: a new publisher lifetime %s: it restarted; %s", wid, when,
            {Rebuild.LOAD_SNAPSHOT: "resetting it from its snapshot",
             Rebuild.REPLAY_FROM_START: "clearing it and replaying the new lifetime",
             Rebuild.KEEP_FROM_NOW: "clearing it (no replay endpoint)"}[how],
        )  # fmt: skip
        if how is Rebuild.LOAD_SNAPSHOT:
            await self._reload(how)  # records the new lifetime before the snapshot
            return
        await self.clear(applied_through=-1)
        if current is None:
            await self.record_lifetime()
        else:
            lifetimes.adopt(wid, current)
        if how is Rebuild.KEEP_FROM_NOW:
            self._services.index.bridge(wid).tolerate_orphans = True
            worker.position.applied_through = None
        elif in_batch:
            await self.replay(0, clear=False)
        else:
            worker.needs_rebuild = True  # replayed from seq 0 at its next batch
        await worker.after_wait()

    # -- rebuilds ------------------------------------------------------------------------

    async def rebuild_as(self, how: Rebuild, reason: str, *, is_loss: bool = True) -> None:
        """Clear the worker and rebuild it ``how``; a resync is counted under ``reason``
        and logged as a warning when it follows a loss (``is_loss``)."""
        wid = self._worker.worker_id
        if how is Rebuild.REPLAY_FROM_START:
            await self.replay(0, clear=True)
            return
        self._services.metrics.resyncs.labels(wid, reason).inc()
        if is_loss:
            log.warning("worker %s: resync (%s)", wid, reason)
        else:
            log.info("worker %s: first lease, loading its entries (%s)", wid, reason)
        await self._reload(how)

    async def replay(self, from_seq: int, *, clear: bool) -> None:
        """Ask the subscriber for batches from ``from_seq`` (they come back to on_batch)."""
        worker = self._worker
        if clear:
            await self.clear(applied_through=-1)
        worker.position.replaying = True
        try:
            # The lock is set down while the replay is fetched: a slow or trickling
            # replay endpoint must not stall the maintenance of this worker (or, through
            # it, anyone else's); the batches are applied under the lock again.
            ok = await self._services.subscriber.request_replay(
                worker.record.worker_id, from_seq, release=worker.lock.released()
            )
        finally:
            worker.position.replaying = False
        self._services.metrics.replays.labels(worker.worker_id, "ok" if ok else "failed").inc()
        # On failure the subscriber has already called on_resync_needed.

    async def _reload(self, how: Rebuild) -> None:
        """Clear the worker, then load its snapshot or keep what arrives from now on."""
        await self.clear(applied_through=None)
        if how is Rebuild.LOAD_SNAPSHOT:
            await self._load_snapshot()
        else:
            self._services.index.bridge(self._worker.worker_id).tolerate_orphans = True

    async def _load_snapshot(self) -> None:
        worker, services = self._worker, self._services
        wid, record = worker.worker_id, worker.record
        assert record.http_url is not None
        bridge = services.index.bridge(wid)
        lease = worker.lease
        await self.record_lifetime()  # before: never newer than the snapshot's
        try:
            snapshot = await worker.unlocked(
                fetch_snapshot(services.session, record.http_url, services.snapshot_timeout_s)
            )
        except PrefixIndexError as exc:
            services.metrics.snapshots.labels(wid, "failed").inc()
            log.error("worker %s: %s; keeping only what arrives from now on", wid, exc)
            bridge.tolerate_orphans = True
            await worker.after_wait()
            return
        if worker.lease is not lease:
            return  # lost while fetching: whoever holds it next rebuilds the worker
        events = snapshot_events(snapshot)
        bridge.tolerate_orphans = True  # runs under an evicted ancestor are unreachable
        try:
            step = services.snapshot_chunk_runs
            for start in range(0, len(events), step):
                batch = KVEventBatch(ts=time.time(), events=list(events[start : start + step]))
                await services.index.apply(wid, batch)
        finally:
            bridge.tolerate_orphans = False
        await services.index.flush(wid)  # the snapshot is in Redis before the stream resumes
        worker.position.applied_through = snapshot.next_seq - 1
        worker.position.applied_ts = None
        services.metrics.snapshots.labels(wid, "ok").inc()
        worker.sync_counters()
        log.info(
            "worker %s: loaded snapshot of %d runs (next seq %d)",
            wid,
            len(events),
            snapshot.next_seq,
        )
        await worker.after_wait()
