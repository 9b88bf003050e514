"""Which router replica ingests which worker: leases taken, renewed, handed over and on.

Router replicas share the ingest. Every maintenance pass renews this router's heartbeat,
and a worker is ingested by its owner among the live routers (rendezvous hashing,
:func:`router.workers.leases.owner_of`). :class:`LeaseKeeper` hands the lease of a worker
this router holds but does not own to the owner, takes a worker it owns, and takes one it
does not own only when the owner left it unclaimed for a whole lease TTL.

A lease given up on purpose (a handover, a shutdown) carries this router's state of the
worker (:mod:`router.ingest.handoff`): the next holder resumes the stream where it
stopped and the worker's entries stay. A lease taken without a valid handoff (its holder
crashed, or someone held it in between) means a rebuild of the worker.

Renewal (:meth:`LeaseKeeper.renew`) takes no worker's lock and runs in a task of its own,
so no worker's ingest (a slow replay, a snapshot being loaded) delays any lease; the
maintenance steps that do take a worker's lock skip a worker whose ingest is busy (the
next pass comes back to it), and a rebuild from a worker's snapshot runs in a task of
its own, so a worker whose snapshot is slow to come delays no pass and no registration.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from redis.exceptions import RedisError

from events.cancellation import cancel_and_wait
from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.ingest.bridged_index import BridgedIndex
from router.ingest.metrics import IngestMetrics
from router.ingest.worker import WorkerIngest
from router.ingest.write_gate import WriteGate
from router.store.scripts import StaleLeaseError
from router.workers.leases import Lease, owner_of
from router.workers.registry import WorkerRegistry

__all__ = ["RECOVERY_ERRORS", "LeaseKeeper"]

log = logging.getLogger(__name__)

RECOVERY_ERRORS = (RedisError, StaleLeaseError, PrefixIndexError)
"""What a worker's write or recovery step may raise; it marks the worker for a rebuild."""


def _needs_rebuild(worker: WorkerIngest) -> bool:
    return worker.needs_rebuild


async def _guarded(worker: WorkerIngest, step: Callable[[], Awaitable[None]]) -> None:
    """Run a step of ``worker``'s recovery; a failure marks it for a rebuild."""
    try:
        await step()
    except RECOVERY_ERRORS as exc:
        worker.recovery.failed(exc)


class LeaseKeeper:
    """The leases of one router replica over the workers it ingests.

    Callers hold no worker lock; the keeper takes each worker's lock around what changes
    the worker's entries.

    Args:
        index: The prefix index (its lease tokens follow the leases held).
        registry: Leases and router heartbeats of the namespace.
        metrics: Where lease counters go.
        gate: Whether the index takes writes (no rebuild is tried while it does not).
    """

    def __init__(
        self,
        index: BridgedIndex,
        registry: WorkerRegistry,
        metrics: IngestMetrics,
        gate: WriteGate,
    ) -> None:
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.gate = gate
        # NOTE: the live routers as of this router's last heartbeat (empty before the
        # first: then every worker counts as its own); per worker it does not own, when
        # it first found the lease free (cleared once anyone holds it).
        self._routers: list[str] = []
        self._holders: list[str] = []
        self._unclaimed_since: dict[str, float] = {}
        # NOTE: the recovery steps in flight in tasks of their own (run_apart), one per
        # worker at most.
        self._apart: dict[WorkerId, asyncio.Task[None]] = {}
        # NOTE: when each held lease's key was last renewed (monotonic; absent: just
        # acquired, due at the next renewal), and when this router's heartbeat last
        # succeeded (monotonic; its leases are its own while it is within a lease TTL).
        self._renewed_at: dict[Lease, float] = {}
        self._beat_at = time.monotonic()
        # NOTE: workers whose lease a take_over() is acquiring now (a second one at once
        # would bump the epoch under the first, whose writes would then be fenced).
        self._taking: set[WorkerId] = set()

    async def renew(self, workers: Iterable[WorkerIngest], *, force: bool = False) -> None:
        """Renew the keys of the leases held among ``workers`` that are due (a third of
        the key's lifetime since the last renewal; all of them with ``force``, or when
        this router's heartbeat was late: its leases may have been taken), in one round
        trip, then this router's membership (and learn the live routers). A lease found
        lost is dropped. Takes no worker's lock: it never waits on an ingest.

        Raises:
            redis.exceptions.RedisError: Redis failed (no lease is taken for lost).
        """
        now = time.monotonic()
        force = force or now - self._beat_at > self.registry.lease_ttl_ms / 1000
        every_s = self.registry.lease_key_ttl_ms / 3000
        held: list[tuple[WorkerIngest, Lease]] = []
        renewed_at: dict[Lease, float] = {}  # (leases no longer held are forgotten)
        for worker in workers:
            lease = worker.lease
            if lease is None:
                continue
            renewed_at[lease] = self._renewed_at.get(lease, now)
            if force or now - renewed_at[lease] >= every_s:
                held.append((worker, lease))
        self._renewed_at = renewed_at
        renewed = await self.registry.renew_all([lease for _, lease in held])
        for (worker, lease), ok in zip(held, renewed, strict=True):
            if ok:
                self._renewed_at[lease] = now
                continue
            self._renewed_at.pop(lease, None)
            if worker.lease is lease:  # not replaced or dropped meanwhile
                self.metrics.lease_lost.labels(worker.worker_id).inc()
                log.warning("worker %s: lease lapsed or taken; retaking it", worker.worker_id)
                worker.recovery.lease_lost()
        await self.heartbeat()

    async def heartbeat(self) -> None:
        """Renew this router's membership and learn the live routers.

        Raises:
            redis.exceptions.RedisError: Redis failed.
        """
        now = time.monotonic()
        self._routers = await self.registry.heartbeat()
        self._holders = await self.registry.hold()
        self._beat_at = now

    @property
    def live_holders(self) -> list[str]:
        """The live lease holders as of this router's last heartbeat (empty before the
        first: then every holder counts as live)."""
        return self._holders

    def owns(self, worker_id: WorkerId) -> bool:
        """Whether this router is the worker's owner among the live routers."""
        return owner_of(worker_id, self._routers) in (None, self.registry.owner)

    async def maintain(self, worker: WorkerIngest, current: Callable[[], bool]) -> None:
        """Hand over or take ``worker``'s lease as ownership says; for a worker held and
        owned, surface a failed queued write and rebuild it if it needs one. A worker
        whose lock is busy is left to the next pass.

        Args:
            worker: The worker.
            current: Whether the worker is still ingested here (checked after waits).
        """
        # NOTE: the lease says which router ingests the worker, not that the worker is
        # alive: it is renewed while the worker is registered here, quiet or not (a SUB
        # socket cannot tell a quiet publisher from a dead one). The service drops a
        # worker it cannot reach (remove_worker), which releases the lease.
        if worker.is_busy:
            return
        owner = owner_of(worker.worker_id, self._routers)
        if worker.lease is not None and owner not in (None, self.registry.owner):
            await self._hand_over(worker, str(owner))
            return
        if worker.lease is None:
            if owner in (None, self.registry.owner) or await self._unclaimed(worker):
                await self.take_over(worker, current)
            return
        async with worker.lock.hold():
            if worker.restore_pending and not worker.needs_rebuild:  # Redis lost its data
                await _guarded(worker, worker.recovery.restore)
            try:  # surfaces a failed queued write of an idle worker
                await self.index.flush(worker.worker_id)
            except RECOVERY_ERRORS as exc:
                worker.recovery.failed(exc)
            if worker.needs_rebuild and worker.record.has_snapshot and self.gate.is_open:
                self.run_apart(worker, worker.recovery.rebuild, when=_needs_rebuild)

    async def take_over(self, worker: WorkerIngest, current: Callable[[], bool]) -> None:
        """Take ``worker``'s lease if free (or handed to this router): resume from the
        previous holder's handoff, else rebuild the worker (later, when the index does
        not take writes now)."""
        wid = worker.worker_id
        if wid in self._taking:
            return  # a registration and a maintenance pass at once: one take is enough
        self._taking.add(wid)
        try:
            await self._take_over(worker, current)
        finally:
            self._taking.discard(wid)

    async def _take_over(self, worker: WorkerIngest, current: Callable[[], bool]) -> None:
        lease = await self.registry.acquire(worker.worker_id, self._holders)
        if lease is None:
            return  # another router replica ingests this worker
        self._renewed_at[lease] = time.monotonic()
        self._unclaimed_since.pop(worker.worker_id, None)
        async with worker.lock.hold():
            if not current():
                await self.registry.release(lease)  # removed while the lease was acquired
                return
            log.info("worker %s: lease acquired (epoch %d)", worker.worker_id, lease.epoch)
            worker.lease = lease
            self.index.use_lease(worker.worker_id, lease.token)
            try:
                handed = await self.registry.take_handoff(worker.worker_id)
            except RedisError:
                handed = None  # rebuilt below (which meets the same Redis trouble)
            if await worker.recovery.resume(lease, handed):
                await _guarded(worker, worker.catch_up)
                return
            if worker.restore_pending and worker.restorable:  # Redis lost its data
                await _guarded(worker, worker.recovery.restore)
                if not worker.needs_rebuild:
                    await _guarded(worker, worker.catch_up)
                    return
            worker.restorable = worker.restore_pending = False
            worker.needs_rebuild = True
            # Snapshot workers are rebuilt now (also when idle); others at their next batch,
            # where a replay can be requested.
            if not self.gate.is_open:
                return
            if worker.record.has_snapshot:
                first = functools.partial(worker.recovery.rebuild, is_first_lease=lease.epoch == 1)
                self.run_apart(worker, first, when=_needs_rebuild)
            else:
                await _guarded(worker, functools.partial(worker.recovery.clear, applied_through=-1))

    async def pass_on(self, worker: WorkerIngest, next_owner: str) -> None:
        """Give up a held lease (callers hold the worker's lock): to ``next_owner`` (``""``:
        parked for any router) with this router's state of the worker once its queued
        writes landed, or plainly when they did not (the next holder then rebuilds it)."""
        lease = worker.lease
        if lease is None:
            return
        try:
            await self.index.flush(worker.worker_id)  # its queued writes land first
            state = await worker.recovery.handoff()
        except RECOVERY_ERRORS:
            state = None
        worker.lease = None
        worker.restorable = False  # given up on purpose: the next holder has the state
        self.index.forget_lease(worker.worker_id)
        if state is not None:
            try:
                if await self.registry.hand_off(lease, next_owner, state):
                    self.metrics.handoffs.labels(worker.worker_id, "sent").inc()
                return
            except RedisError as exc:  # e.g. a state over Redis's bulk limit
                log.warning(
                    "worker %s: handing its state on failed (%s, %d bytes); releasing the "
                    "lease plainly (the next holder rebuilds the worker)",
                    worker.worker_id,
                    exc,
                    len(state),
                )
        await self.registry.release(lease)

    async def settle(self, worker_id: WorkerId | None = None) -> None:
        """Wait for the step run apart for ``worker_id`` (``None``: for every worker)."""
        tasks = [t for w, t in self._apart.items() if worker_id in (None, w)]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the steps run apart (a worker left half rebuilt is rebuilt by its next
        holder: its lease goes on without a handoff, as its state is not known)."""
        await cancel_and_wait(list(self._apart.values()))

    def run_apart(
        self,
        worker: WorkerIngest,
        step: Callable[[], Awaitable[None]],
        *,
        when: Callable[[WorkerIngest], bool] = lambda _: True,
    ) -> None:
        """Run ``step`` (a recovery step that may wait on the worker's snapshot) in a task
        of its own, so no maintenance pass, registration or watchdog round waits on one
        worker's network. It runs under the worker's lock, only while the lease held now
        is still held, no network wait of its ingest is in flight and ``when(worker)``
        still holds (its batch path may have done it first); none is started while one
        runs for the worker."""
        wid, lease = worker.worker_id, worker.lease
        if wid in self._apart:
            return

        async def run() -> None:
            try:
                async with worker.changing():
                    if worker.lease is lease and not worker.is_waiting and when(worker):
                        await _guarded(worker, step)
            except Exception as exc:  # a bug: the worker is rebuilt later
                log.exception("worker %s: a recovery step failed", wid)
                worker.recovery.failed(exc)
            finally:
                self._apart.pop(wid, None)

        self._apart[wid] = asyncio.create_task(run(), name=f"kvroute-recovery[{wid}]")

    def successor(self, worker_id: WorkerId) -> str:
        """Who a leaving router hands the worker to: its owner among the other live
        routers, or ``""`` (parked for any router) when none is left."""
        others = [router for router in self._routers if router != self.registry.owner]
        return owner_of(worker_id, others) or ""

    async def _hand_over(self, worker: WorkerIngest, owner: str) -> None:
        """Give the lease of a worker another live router owns to that router (callers
        checked its lock was free; the handoff waits for nothing but Redis)."""
        async with worker.lock.hold():
            if worker.lease is None:
                return
            await self.pass_on(worker, owner)
        self.metrics.handovers.labels(worker.worker_id).inc()
        log.info("worker %s: lease handed over to router %s (its owner)", worker.worker_id, owner)

    async def _unclaimed(self, worker: WorkerIngest) -> bool:
        """True once the worker's lease has been free (or held by a router no longer
        live) for a whole TTL (its owner is not taking it: stalled, or its ingest
        broken): then any router may."""
        wid = worker.worker_id
        token = await self.registry.holder(WorkerId(wid))
        holder = None if token is None else token.partition(":")[2]
        if holder is not None and (not self._holders or holder in self._holders):
            self._unclaimed_since.pop(wid, None)
            return False
        since = self._unclaimed_since.setdefault(wid, time.monotonic())
        return time.monotonic() - since >= self.registry.lease_ttl_ms / 1000
