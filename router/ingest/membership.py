"""The ingest's worker set: the workers registered through this router and those saved by others.

Adding a worker subscribes to its stream before its registration is saved, so a saved
registration always has a subscription behind it; removing one unsubscribes it and deletes
its registration; a sync follows the registrations other routers saved or replaced
(:class:`router.workers.registry_watch.RegistryWatch`: only when the registry changed).
All three hold one lock, so a removal is never undone by a sync.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence

import msgspec
import zmq

from events.errors import EventsError
from events.identity import WorkerId
from router.ingest.capacity import CapacityError
from router.ingest.ownership import LeaseKeeper
from router.ingest.worker import WorkerIngest
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry
from router.workers.registry_watch import RegistryWatch

__all__ = ["IngestMembership"]


class IngestMembership:
    """Adds and removes an ingest's workers, and follows the saved registrations.

    Args:
        workers: The ingest's workers (worker id -> its ingest); changed only through
            ``subscribe`` and ``unsubscribe``.
        registry: Registrations and leases of the namespace.
        leases: The ingest's lease keeper.
        subscribe: Subscribes to a record's stream and adds its worker (on failure
            nothing of it is kept).
        unsubscribe: Stops reading a worker's stream, drops its entries and releases its
            lease.
        is_current: Whether a worker is still the one ingested under its id.
    """

    def __init__(
        self,
        workers: Mapping[WorkerId, WorkerIngest],
        registry: WorkerRegistry,
        leases: LeaseKeeper,
        *,
        subscribe: Callable[[WorkerRecord], Awaitable[WorkerIngest]],
        unsubscribe: Callable[[WorkerIngest], Awaitable[None]],
        is_current: Callable[[WorkerIngest], bool],
    ) -> None:
        self._workers = workers
        self.registry = registry
        self._leases = leases
        self._subscribe = subscribe
        self._unsubscribe = unsubscribe
        self._is_current = is_current
        # NOTE: held while the set of workers changes (add, remove, the maintenance's
        # registry sync), so a removal is never undone by a sync that read the registry
        # before the registration was deleted.
        self._lock = asyncio.Lock()
        self._registry_watch = RegistryWatch(registry)

    async def start(self, records: Sequence[WorkerRecord]) -> None:
        """Register ``records`` (replacing what is saved under their ids), then follow the
        saved registrations."""
        async with self._lock:
            for record in records:  # the operator's flags and config replace saved ones
                await self._add(record, replace=True)
            await self._sync_registry()

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
        async with self._lock:
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
        async with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                await self._unsubscribe(worker)
            saved = await self.registry.unregister(worker_id)
        return saved or worker is not None

    async def sync(self) -> None:
        """Follow the saved registrations (see :meth:`_sync_registry`)."""
        async with self._lock:
            await self._sync_registry()

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
