"""One worker's ingest: what the router knows of the worker, and the path that folds its batches.

:class:`WorkerIngest` holds what the router knows of one registered worker (its lease, how
far its stream is folded, whether it needs a rebuild) and runs its batch path; its
recovery paths (handoff, restore, resync, rebuilds, restarts) are its
:attr:`WorkerIngest.recovery` (:mod:`router.ingest.worker_recovery`).
:class:`router.ingest.service.IndexIngest` owns one per worker, serialises the calls with the
worker's :attr:`WorkerIngest.lock` and turns errors into
:meth:`router.ingest.worker_recovery.WorkerRecovery.failed`. Which rebuild follows which
loss is decided by :mod:`router.ingest.recovery`.

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
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TypeVar

import aiohttp
from prometheus_client import Counter

from events.identity import WorkerId
from events.subscriber import EventSubscriber, ReceivedBatch
from router.errors import OrphanParentError
from router.ingest.bridge import BridgeCounters
from router.ingest.bridged_index import BridgedIndex
from router.ingest.metrics import IngestMetrics
from router.ingest.recovery import KeptStream, Rebuild, RecoveryRules, Restart, StreamPosition
from router.ingest.task_lock import TaskLock
from router.ingest.worker_recovery import WorkerRecovery
from router.ingest.write_gate import WriteGate
from router.workers.leases import Lease
from router.workers.lifetime import LifetimeTracker
from router.workers.registry import WorkerRecord

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
        # NOTE: network waits in progress with the lock set down (see unlocked); while
        # any is, deliveries go to _kept.
        self._waits = 0
        # NOTE: set when a restart was found by the worker's lifetime (a periodic or
        # position check, a handoff) while its stream still stood in the old lifetime:
        # the seq drop that stream shows next is that restart, already reset for. Cleared
        # by the next delivered batch (a drop after one is a restart of its own).
        self.restart_ahead_of_stream = False
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
        self.recovery = WorkerRecovery(self, services)

    @property
    def worker_id(self) -> WorkerId:
        """The worker's id."""
        return self.record.worker_id

    @property
    def is_waiting(self) -> bool:
        """Whether a replay, a snapshot or a lifetime read is awaited with the lock set
        down (whoever takes the lock meanwhile must leave the worker's entries alone)."""
        return self.position.replaying or self.is_lock_set_down

    @property
    def is_lock_set_down(self) -> bool:
        """Whether a network wait of its ingest holds the lock set down (see :meth:`unlocked`)."""
        return self._waits > 0

    def changing(self) -> Changing:
        """``async with worker.changing():`` around a step that changes the worker's
        entries (a batch, a reset, a resync, a recovery step): holds :attr:`lock`, and a
        step cut short by a cancellation (the router closing, the worker removed) marks
        the worker for a rebuild, so what it left half done is never handed on."""
        return Changing(self)

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
        if self.restart_ahead_of_stream:
            self.restart_ahead_of_stream = False
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
        self.restart_ahead_of_stream = False
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
        if await self.unlocked(self._services.lifetimes.changed(self.record)):
            await self.recovery.reset_lifetime("since the handoff", in_batch=False)
        await self._apply_kept(in_batch=False)

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
                await self.recovery.restarted_unseen(item.seq)
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
            await self.recovery.rebuild()
        if self.position.restarted(received.seq, received.batch.ts):
            await self.recovery.restarted_unseen(received.seq)
        first_missing = self.position.first_missing(received.seq)
        if first_missing is not None:
            if not in_batch:
                return False
            if await self.unlocked(self._services.lifetimes.changed(self.record)):
                await self.recovery.reset_lifetime(f"at seq {received.seq}", in_batch=True)
            else:
                # Batches before this one never reached the index (a late join, a
                # snapshot older than the stream): fetch them; the replay redelivers
                # this one too.
                await self.recovery.replay(first_missing, clear=False)
        if self._covered(received) or self.lease is None:
            return True  # (the lease may have gone while a replay was fetched)
        try:
            await index.apply(wid, received.batch)
        except OrphanParentError as exc:
            metrics.orphans.labels(wid).inc()
            self.sync_counters()
            how = self.rules.after_orphan(replaying=self.position.replaying)
            if how is Rebuild.REPLAY_FROM_START and not in_batch:
                log.warning("%s; worker %s will be rebuilt at its next batch", exc, wid)
                self.needs_rebuild = True
                return False
            if how is Rebuild.REPLAY_FROM_START:
                log.warning("%s; replaying worker %s from seq 0", exc, wid)
            else:
                log.warning("%s; resyncing worker %s", exc, wid)
            await self.recovery.rebuild_as(how, "orphan_parent")
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
        self.sync_counters()

    def sync_counters(self) -> None:
        """Count what the worker's bridge skipped since the last call (and flag a block
        size mismatch)."""
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

    # -- for the recovery paths ----------------------------------------------------------

    def resumed(self, applied_through: int | None, applied_ts: float | None) -> None:
        """The stream continues after batch ``(applied_through, applied_ts)`` of a bridge
        handed over by the lease's previous holder: what that holder applied is dropped
        from the kept batches."""
        self.position.applied_through = applied_through
        self.position.applied_ts = applied_ts
        self.needs_rebuild = False
        self._seen = BridgeCounters()
        if self._kept is not None:
            self._kept.drop_through(applied_through, applied_ts)

    async def unlocked(self, wait: Awaitable[T]) -> T:
        """Await ``wait`` (a network request) with the lock set down: see the module
        docstring for what happens meanwhile."""
        self._waits += 1
        try:
            async with self.lock.released():
                return await wait
        finally:
            self._waits -= 1

    async def after_wait(self) -> None:
        """Apply what was delivered during a network wait (outside a batch, up to the
        first batch that needs a replay; the rest go in before the next batch)."""
        await self._apply_kept(in_batch=self.in_batch)


class Changing:
    """One ``async with worker.changing()`` (a plain class: one is taken per batch)."""

    __slots__ = ("_hold", "_worker")

    def __init__(self, worker: WorkerIngest) -> None:
        self._worker = worker
        self._hold = worker.lock.hold()

    async def __aenter__(self) -> None:
        await self._hold.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is asyncio.CancelledError:
            self._worker.needs_rebuild = True  # left half done: no handoff of this state
        await self._hold.__aexit__(exc_type, exc, tb)
