"""One worker's ingest: folds its batches into the index and rebuilds its entries after a loss.

:class:`WorkerIngest` holds what the router knows of one registered worker (its lease, how
far its stream is folded, whether it needs a rebuild) and runs its batch path and recovery
paths; :class:`router.ingest.service.IndexIngest` owns one per worker, serialises the calls with the
worker's :attr:`WorkerIngest.lock` and turns errors into :meth:`WorkerIngest.failed`. Which
rebuild follows which loss is decided by :mod:`router.ingest.recovery`.

No lock is held across a network wait: for a replay, a snapshot or a lifetime read the
worker's lock is set down and taken again to apply what came. Meanwhile the worker counts
as busy (:attr:`WorkerIngest.is_busy`: maintenance leaves it to the next pass), batches
delivered by the stream are kept and applied in order afterwards, a resync signal marks
it for a rebuild, and the lease is checked again on the way back (it may have gone).
While the index refuses writes for lack of memory (:mod:`router.ingest.write_gate`),
batches are dropped, counted, and the worker rebuilt once the gate opens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp
from prometheus_client import Counter
from redis.exceptions import RedisError

from events.identity import WorkerId
from events.schema import KVEventBatch
from events.subscriber import EventSubscriber, ReceivedBatch
from router.errors import OrphanParentError, PrefixIndexError
from router.ingest.bridge import BridgeCounters
from router.ingest.bridged_index import BridgedIndex
from router.ingest.handoff import HandoffError, decode_handoff, encode_handoff
from router.ingest.metrics import IngestMetrics
from router.ingest.recovery import KeptStream, Rebuild, RecoveryRules, Restart, StreamPosition
from router.ingest.task_lock import TaskLock
from router.ingest.write_gate import WriteGate, shut_reason
from router.store.scripts import StaleLeaseError
from router.workers.leases import Lease
from router.workers.lifetime import LifetimeTracker
from router.workers.registry import WorkerRecord
from router.workers.snapshot import fetch_snapshot, snapshot_events

__all__ = ["IngestServices", "WorkerIngest"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IngestServices:
    """What every worker's ingest shares (made by ``IndexIngest.start``).

    Attributes:
        index: The prefix index written, through the workers' bridges.
        metrics: Where counters go.
        subscriber: The event subscriber, asked for replays.
        session: The HTTP session snapshots are fetched with.
        lifetimes: The workers' recorded publisher lifetimes.
        gate: Whether the index takes writes (shut while Redis is out of memory).
        snapshot_timeout_s: Timeout of one ``GET /v1/snapshot``.
        snapshot_chunk_runs: Snapshot runs written per index batch.
    """

    index: BridgedIndex
    metrics: IngestMetrics
    subscriber: EventSubscriber
    session: aiohttp.ClientSession
    lifetimes: LifetimeTracker
    gate: WriteGate
    snapshot_timeout_s: float
    snapshot_chunk_runs: int


class WorkerIngest:
    """The ingest of one registered worker (callers hold :attr:`lock` around every call).

    Args:
        record: The worker's registration.
        services: What all workers' ingests share.
    """

    def __init__(self, record: WorkerRecord, services: IngestServices) -> None:
        self.record = record
        self.rules = RecoveryRules(
            has_snapshot=record.has_snapshot, can_replay=record.replay_endpoint is not None
        )
        self.lease: Lease | None = None
        self.position = StreamPosition()
        self.needs_rebuild = False
        # NOTE: restorable: the lease was lost by surprise (lapsed, refused by a fenced
        # write) with no rebuild pending, so the bridge holds every batch applied (those
        # since are kept, not dropped); if Redis lost its data (restore_pending, set by
        # the ingest from its markers) the entries are written again from the bridge
        # instead of being rebuilt.
        self.restorable = False
        self.restore_pending = False
        self.in_batch = False
        # NOTE: held by whatever changes the worker's entries (see TaskLock).
        self.lock = TaskLock()
        self._services = services
        self._seen = BridgeCounters()
        # NOTE: what is delivered without the lease while a handoff is expected (see
        # keep_batches), applied before the next batch once the lease is held.
        self._kept: KeptStream | None = None
        self._draining = False
        # NOTE: network waits in progress with the lock set down (see _unlocked); while
        # any is, deliveries go to _kept.
        self._waits = 0
        # NOTE: set when a restart was found by the worker's lifetime (a periodic or
        # position check, a handoff) while its stream still stood in the old lifetime:
        # the seq drop that stream shows next is that restart, already reset for. Cleared
        # by the next delivered batch (a drop after one is a restart of its own).
        self._restart_ahead_of_stream = False
        # NOTE: the block size the worker's events carry when it is not the registered
        # one (None: they agree, as far as seen); published in Redis by the maintenance
        # pass while flag_synced is False (at first too: a flag left by an earlier
        # registration of the worker is dropped once this one's lease is held).
        self.events_block_size: int | None = None
        self.flag_synced = False
        # NOTE: the per-batch counters' labelled children, looked up once: a labels() call
        # costs about a microsecond, as much as folding two blocks.
        wid, metrics = self.worker_id, services.metrics
        outcomes = ("applied", "covered", "not_owner", "index_full")
        self._batches = {o: metrics.batches.labels(wid, o) for o in outcomes}
        self._events: dict[type, Counter] = {}
        services.index.expect_block_size(wid, record.block_size)
        metrics.block_size_mismatch.labels(wid).set(0)

    @property
    def worker_id(self) -> WorkerId:
        """The worker's id."""
        return self.record.worker_id

    @property
    def is_waiting(self) -> bool:
        """Whether a replay, a snapshot or a lifetime read is awaited with the lock set
        down (whoever takes the lock meanwhile must leave the worker's entries alone)."""
        return self.position.replaying or self._waits > 0

    @property
    def is_busy(self) -> bool:
        """Whether its ingest is at work: the lock is held, or :attr:`is_waiting`.
        Maintenance leaves a busy worker to its next pass."""
        return self.lock.is_held or self.is_waiting

    # -- batch path ----------------------------------------------------------------------

    def keep_batches(self, keep: bool) -> None:
        """Keep (or stop keeping) the batches delivered while this router does not hold the
        lease: set while a handoff to this router is expected, so the batches the previous
        holder did not apply are applied from here, not lost."""
        if not keep:
            self._kept = None
            if self.restorable:  # the bridge kept for a restore misses batches from now on
                self.restorable = False
                self._services.index.forget_lease(self.worker_id)
        elif self._kept is None:
            self._kept = KeptStream()

    def note_restart(self, seq: int) -> bool:
        """The subscriber saw the publisher restart (a seq drop to ``seq``): True when
        nothing more is to be done here, because the restart was already reset for (found
        by the worker's lifetime before its stream showed it), or because batches are
        being kept (as during a network wait) and it joins them in order (applied there)."""
        if self._restart_ahead_of_stream:
            self._restart_ahead_of_stream = False
            log.info(
                "worker %s: its stream shows the restart already reset for (seq %d)",
                self.worker_id,
                seq,
            )
            return True
        if self._waits:
            self.keep_batches(True)
        if self._kept is None:
            return False
        self._kept.add(Restart(seq))
        return True

    async def apply_batch(self, received: ReceivedBatch) -> None:
        """Apply one delivered batch (see :mod:`router.ingest.service` for the recovery paths),
        after any batches kept while the lease was on its way (or while a network wait
        had the lock set down)."""
        self._restart_ahead_of_stream = False
        if self._waits:
            self.keep_batches(True)
            assert self._kept is not None
            self._kept.add(received)
            return
        if self.lease is None:
            if self._kept is not None:
                self._kept.add(received)
            else:
                self.restorable = False  # the bridge misses this batch now
            self._batches["not_owner"].inc()
            return
        await self._apply_kept(in_batch=True)
        await self._apply_one(received, in_batch=True)

    async def catch_up(self) -> None:
        """After a resumed takeover, from the maintenance pass that took the lease: reset a
        worker whose publisher lifetime is no longer the handed-over one (it restarted
        meanwhile, quiet since), then apply the batches kept while the lease was on its
        way, up to the first that needs a replay (only the batch path may ask for one);
        the rest go in before the next delivered batch."""
        if await self._unlocked(self._services.lifetimes.changed(self.record)):
            await self._reset_lifetime("since the handoff", in_batch=False)
        await self._apply_kept(in_batch=False)

    async def check_lifetime(self, current: str | None) -> None:
        """The periodic check: ``current`` is the lifetime id the worker reports now (read
        without the lock); a new one means it restarted unseen (its new lifetime's first
        batches lost, and the rest continuous or not sent yet), so it is reset."""
        lifetimes = self._services.lifetimes
        if self.lease is None or current is None or self.position.replaying:
            return
        recorded = lifetimes.recorded(self.worker_id)
        if recorded is None:
            lifetimes.adopt(self.worker_id, current)
        elif recorded != current:
            await self._reset_lifetime(
                "found by the periodic check", in_batch=False, current=current
            )

    async def _apply_kept(self, *, in_batch: bool) -> None:
        if self._draining:
            # A replay asked for by a kept batch is being delivered: the batches it
            # redelivers go in on their own, and the outer drain skips what they cover.
            return
        self._draining = True
        try:
            await self._drain_kept(in_batch=in_batch)
        finally:
            self._draining = False

    async def _drain_kept(self, *, in_batch: bool) -> None:
        kept = self._kept
        while kept:
            item = kept.first()
            if isinstance(item, Restart):
                await self._restarted_unseen(item.seq)
            elif not await self._apply_one(item, in_batch=in_batch):
                return
            kept.pop()
        self._kept = None

    async def _apply_one(self, received: ReceivedBatch, *, in_batch: bool) -> bool:
        """Apply one batch; False (nothing more done) where it needs a replay and
        ``in_batch`` is False: outside the subscriber's delivery, asking for one could
        deadlock with it."""
        wid, index, metrics = self.worker_id, self._services.index, self._services.metrics
        if self.lease is None:
            return True  # lost while applying the batches kept before this one
        if not self._services.gate.is_open:
            # Redis refuses writes: drop the batch, rebuild the worker once it takes them.
            self.needs_rebuild = True
            self.restorable = False
            self._batches["index_full"].inc()
            return True
        if self.needs_rebuild:
            if not in_batch:
                return False
            await self.rebuild()
        if self.position.restarted(received.seq, received.batch.ts):
            await self._restarted_unseen(received.seq)
        first_missing = self.position.first_missing(received.seq)
        if first_missing is not None:
            if not in_batch:
                return False
            if await self._unlocked(self._services.lifetimes.changed(self.record)):
                await self._reset_lifetime(f"at seq {received.seq}", in_batch=True)
            else:
                # Batches before this one never reached the index (a late join, a
                # snapshot older than the stream): fetch them; the replay redelivers
                # this one too.
                await self._replay(first_missing, clear=False)
        if self._covered(received) or self.lease is None:
            return True  # (the lease may have gone while a replay was fetched)
        try:
            await index.apply(wid, received.batch)
        except OrphanParentError as exc:
            metrics.orphans.labels(wid).inc()
            self._sync_counters()
            how = self.rules.after_orphan(replaying=self.position.replaying)
            if how is Rebuild.REPLAY_FROM_START and not in_batch:
                log.warning("%s; worker %s will be rebuilt at its next batch", exc, wid)
                self.needs_rebuild = True
                return False
            if how is Rebuild.REPLAY_FROM_START:
                log.warning("%s; replaying worker %s from seq 0", exc, wid)
            else:
                log.warning("%s; resyncing worker %s", exc, wid)
            await self._rebuild_as(how, "orphan_parent")
            if self._covered(received) or self.lease is None:
                return True
            # Rebuilt without this batch (tolerant mode now, or a snapshot older than
            # it): apply it once more; an orphan left now is claimed by nobody (safe).
            try:
                await index.apply(wid, received.batch)
            except OrphanParentError:
                metrics.orphans.labels(wid).inc()
        self._applied(received)
        return True

    def _covered(self, received: ReceivedBatch) -> bool:
        """True (and counted) when the index already holds the batch's effect."""
        if not self.position.covers(received.seq):
            return False
        self._batches["covered"].inc()
        return True

    def _applied(self, received: ReceivedBatch) -> None:
        self.position.applied_through = received.seq
        self.position.applied_ts = received.batch.ts
        self._batches["applied"].inc()
        kinds: dict[type, int] = {}
        for event in received.batch.events:
            kinds[type(event)] = kinds.get(type(event), 0) + 1
        for kind, count in kinds.items():
            counter = self._events.get(kind)
            if counter is None:
                events = self._services.metrics.events
                counter = self._events[kind] = events.labels(self.worker_id, kind.__name__)
            counter.inc(count)
        self._sync_counters()

    def _sync_counters(self) -> None:
        bridge = self._services.index.bridge(self.worker_id)
        now = bridge.counters
        before = self._seen
        if now == before:  # the common case: nothing skipped
            return
        reasons = ("malformed", "unknown_removals", "detached", "ignored_groups",
                   "block_size_mismatch")  # fmt: skip
        for reason in reasons:
            delta = getattr(now, reason) - getattr(before, reason)
            if delta > 0:
                self._services.metrics.skipped.labels(self.worker_id, reason).inc(delta)
        if now.block_size_mismatch > before.block_size_mismatch:
            self._flag_block_size(bridge.mismatched_block_size)
        self._seen = replace(now)

    def _flag_block_size(self, seen: int) -> None:
        """The worker's events carry block size ``seen``, not its registered one."""
        if seen == self.events_block_size:
            return
        self.events_block_size = seen
        self.flag_synced = False
        self._services.metrics.block_size_mismatch.labels(self.worker_id).set(1)
        log.error(
            "worker %s: its events carry block size %d but it is registered with %d; "
            "their BlockStored events are dropped (counted) until it is registered with "
            "its real block size",
            self.worker_id,
            seen,
            self.record.block_size,
        )

    # -- lease handoff -------------------------------------------------------------------

    async def handoff(self) -> bytes | None:
        """This router's state of the worker, for the next holder of its lease.

        ``None`` when the state is not known to match the worker's entries (a rebuild is
        pending, or a replay is being delivered); call it after the worker's queued writes
        landed. Encoded in a thread (a large worker's state takes a while, which the event
        loop need not wait on): the caller's hold on :attr:`lock` keeps the bridge still.
        """
        if self.lease is None or self.needs_rebuild or self.position.replaying or self._waits:
            return None
        return await asyncio.to_thread(
            encode_handoff,
            self._services.index.bridge(self.worker_id),
            self.lease.epoch,
            self.position.applied_through,
            self.position.applied_ts,
            self._services.lifetimes.recorded(self.worker_id),
        )

    async def resume(self, lease: Lease, data: bytes | None) -> bool:
        """Continue from the state the lease's previous holder handed over (``data``).

        True when it was taken: the bridge, the stream position and the lifetime id are
        the previous holder's, and the worker's entries stay as they are; the kept
        batches the previous holder did not apply (and restarts seen since) follow, from
        :meth:`catch_up` or the next batch. False (counted and logged) when there was
        none, it is unreadable, or it is stale; then the caller rebuilds the worker.
        """
        wid, services = self.worker_id, self._services
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
        self.position.applied_through = handoff.applied_through
        self.position.applied_ts = handoff.applied_ts
        self.needs_rebuild = False
        self._seen = BridgeCounters()
        services.metrics.handoffs.labels(wid, "resumed").inc()
        log.info(
            "worker %s: resumed from the handed-over state (through seq %s); entries kept",
            wid,
            handoff.applied_through,
        )
        if self._kept is not None:
            self._kept.drop_through(handoff.applied_through, handoff.applied_ts)
        return True

    # -- recovery ------------------------------------------------------------------------

    def lease_lost(self) -> None:
        """The lease lapsed or was refused (not given up): keep the batches delivered
        from now on, and the bridge for a restore unless a rebuild was pending anyway
        (see :attr:`restorable`)."""
        self.lease = None
        self.restorable = not self.needs_rebuild
        self._services.index.forget_lease(self.worker_id, keep_bridge=self.restorable)
        self.keep_batches(True)

    async def restore(self) -> None:
        """Redis lost the worker's entries (some or all) while this router held them: write
        them again from the bridge, which holds every batch applied, instead of
        rebuilding the worker from its events."""
        wid, services = self.worker_id, self._services
        written = await services.index.rewrite_worker(wid)
        self.restorable = self.restore_pending = self.needs_rebuild = False
        services.metrics.restores.labels(wid).inc()
        log.warning("worker %s: Redis lost its entries; wrote its %d entries again", wid, written)

    async def resync(self, reason: str) -> None:
        """Batches were lost for good: clear the worker and rebuild what can be (later,
        when a network wait of its ingest is in progress: marked for a rebuild)."""
        if self._waits:
            self.needs_rebuild = True
            return
        await self._rebuild_as(self.rules.after_loss(), reason)

    async def record_lifetime(self) -> None:
        """Record the lifetime id the worker reports now (read with the lock set down)."""
        lifetimes = self._services.lifetimes
        lifetimes.adopt(self.worker_id, await self._unlocked(lifetimes.current(self.record)))

    async def rebuild(self, *, is_first_lease: bool = False) -> None:
        """After a lease (re)acquisition or a failure: rebuild the worker from scratch.

        Args:
            is_first_lease: The worker's first lease ever (epoch 1): nothing was indexed
                before, so nothing was lost and the rebuild is an ordinary start (logged
                at INFO; a rebuild after a loss is a WARNING).
        """
        self.needs_rebuild = False
        how = self.rules.after_takeover(in_batch=self.in_batch)
        await self._rebuild_as(how, "rebuild", is_loss=not is_first_lease)

    async def clear(self, applied_through: int | None) -> None:
        """Drop the worker's entries; the stream continues after ``applied_through``."""
        self.restorable = self.restore_pending = False
        index = self._services.index
        await index.clear_worker(self.worker_id)
        index.bridge(self.worker_id).tolerate_orphans = False
        self.position.applied_through = applied_through
        self.position.applied_ts = None

    def failed(self, exc: Exception) -> None:
        """A write failed (``exc``): drop a lost lease, rebuild the worker later (once the
        index takes writes again, when Redis is out of memory or unreachable: the write
        gate then drops every worker's batches until it answers)."""
        wid, metrics = self.worker_id, self._services.metrics
        if isinstance(exc, StaleLeaseError):
            metrics.lease_lost.labels(wid).inc()
            log.warning("worker %s: lost its lease (%s); maintenance will retake it", wid, exc)
            self.lease_lost()
        else:
            # A write that failed on a Redis error may be followed by batches that meet
            # the same trouble: this worker is rebuilt, not restored from its bridge.
            self.restorable = False
            if isinstance(exc, RedisError):
                metrics.redis_errors.labels(wid).inc()
            if shut_reason(exc) is not None:
                self._services.gate.refused(exc, f"worker {wid}")  # says so once per interval
            else:
                log.warning("worker %s: index write failed (%s); it will be rebuilt", wid, exc)
        self.needs_rebuild = True

    async def _rebuild_as(self, how: Rebuild, reason: str, *, is_loss: bool = True) -> None:
        """Clear the worker and rebuild it ``how``; a resync is counted under ``reason``
        and logged as a warning when it follows a loss (``is_loss``)."""
        if how is Rebuild.REPLAY_FROM_START:
            await self._replay(0, clear=True)
            return
        self._services.metrics.resyncs.labels(self.worker_id, reason).inc()
        if is_loss:
            log.warning("worker %s: resync (%s)", self.worker_id, reason)
        else:
            log.info("worker %s: first lease, loading its entries (%s)", self.worker_id, reason)
        await self._reload(how)

    async def _replay(self, from_seq: int, *, clear: bool) -> None:
        """Ask the subscriber for batches from ``from_seq`` (they come back to on_batch)."""
        if clear:
            await self.clear(applied_through=-1)
        self.position.replaying = True
        try:
            # The lock is set down while the replay is fetched: a slow or trickling
            # replay endpoint must not stall the maintenance of this worker (or, through
            # it, anyone else's); the batches are applied under the lock again.
            ok = await self._services.subscriber.request_replay(
                self.record.worker_id, from_seq, release=self.lock.released()
            )
        finally:
            self.position.replaying = False
        self._services.metrics.replays.labels(self.worker_id, "ok" if ok else "failed").inc()
        # On failure the subscriber has already called on_resync_needed.

    async def _restarted_unseen(self, seq: int) -> None:
        """The publisher restarted while another router held the lease (a seq drop seen
        meanwhile, or a batch that reuses a seq the index holds, stamped later): the
        worker's entries are of the old lifetime."""
        self._services.metrics.resets.labels(self.worker_id).inc()
        log.warning(
            "worker %s: its publisher restarted (at seq %d) while the lease moved; "
            "clearing it",
            self.worker_id,
            seq,
        )
        await self.clear(applied_through=-1)
        await self.record_lifetime()

    async def _reset_lifetime(
        self, when: str, *, in_batch: bool, current: str | None = None
    ) -> None:
        """The worker restarted and its new lifetime's first batches were lost (or
        reached another router): clear it and rebuild it from the new lifetime.

        Args:
            when: Where the new lifetime was seen (for the log).
            in_batch: Called from the subscriber's delivery (a replay may be asked for).
            current: The new lifetime id when already read (else it is read now).
        """
        wid, lifetimes = self.worker_id, self._services.lifetimes
        how = self.rules.after_restart()
        self._restart_ahead_of_stream = not in_batch
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
            self.position.applied_through = None
        elif in_batch:
            await self._replay(0, clear=False)
        else:
            self.needs_rebuild = True  # replayed from seq 0 at its next batch
        await self._after_wait()

    async def _reload(self, how: Rebuild) -> None:
        """Clear the worker, then load its snapshot or keep what arrives from now on."""
        await self.clear(applied_through=None)
        if how is Rebuild.LOAD_SNAPSHOT:
            await self._load_snapshot()
        else:
            self._services.index.bridge(self.worker_id).tolerate_orphans = True

    async def _load_snapshot(self) -> None:
        wid, record, services = self.worker_id, self.record, self._services
        assert record.http_url is not None
        bridge = services.index.bridge(wid)
        lease = self.lease
        await self.record_lifetime()  # before: never newer than the snapshot's
        try:
            snapshot = await self._unlocked(
                fetch_snapshot(services.session, record.http_url, services.snapshot_timeout_s)
            )
        except PrefixIndexError as exc:
            services.metrics.snapshots.labels(wid, "failed").inc()
            log.error("worker %s: %s; keeping only what arrives from now on", wid, exc)
            bridge.tolerate_orphans = True
            await self._after_wait()
            return
        if self.lease is not lease:
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
        self.position.applied_through = snapshot.next_seq - 1
        self.position.applied_ts = None
        services.metrics.snapshots.labels(wid, "ok").inc()
        self._sync_counters()
        log.info(
            "worker %s: loaded snapshot of %d runs (next seq %d)",
            wid,
            len(events),
            snapshot.next_seq,
        )
        await self._after_wait()

    async def _unlocked(self, wait: Awaitable[T]) -> T:
        """Await ``wait`` (a network request) with the lock set down: see the module
        docstring for what happens meanwhile."""
        self._waits += 1
        try:
            async with self.lock.released():
                return await wait
        finally:
            self._waits -= 1

    async def _after_wait(self) -> None:
        """Apply what was delivered during a network wait (outside a batch, up to the
        first batch that needs a replay; the rest go in before the next batch)."""
        await self._apply_kept(in_batch=self.in_batch)
