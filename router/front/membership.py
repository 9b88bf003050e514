"""A router replica's worker set: workers registered, adopted from other replicas, retired, revived.

A worker registered through this replica is ingested (:mod:`router.ingest.service`) and
polled (:mod:`router.load.reports`); one registered through another replica is adopted
when the registry changes (:class:`router.workers.registry_watch.RegistryWatch`). A worker
whose ``GET /health`` stays unanswered for ``dead_after_s`` is unregistered and its
record kept (:mod:`router.workers.liveness`), so it is registered anew once it answers
again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from events.identity import WorkerId
from router.front.lookup import INDEX_ERRORS
from router.front.worker_view import WorkerView
from router.ingest.service import IndexIngest
from router.load.reports import WorkerReportPoller
from router.workers.liveness import Liveness
from router.workers.registration import RegistrationError
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry
from router.workers.registry_watch import RegistryWatch

__all__ = ["WorkerMembership"]

logger = logging.getLogger(__name__)


class WorkerMembership:
    """Registers, unregisters, adopts, retires and revives a replica's workers.

    Args:
        records: The replica's records (worker id -> record), written only here.
        view: The routing view of ``records``, told of every change.
        registry: The registry the other replicas register through.
        ingest: The replica's ingest (saves registrations, reads event streams).
        poller: The replica's load and health polls.
        dead_after_s: How long a worker may stay unreachable before it is retired.
        admit: Refuses a record this replica does not admit (raises
            :class:`router.workers.registration.RegistrationError`).
        on_drop: Forgets what the rest of the replica keeps of a worker dropped.
    """

    def __init__(
        self,
        records: dict[WorkerId, WorkerRecord],
        view: WorkerView,
        registry: WorkerRegistry,
        ingest: IndexIngest,
        poller: WorkerReportPoller,
        dead_after_s: float,
        *,
        admit: Callable[[WorkerRecord], None],
        on_drop: Callable[[WorkerId], None],
    ) -> None:
        self._records = records
        self._view = view
        self._registry_watch = RegistryWatch(registry)
        self.ingest = ingest
        self.poller = poller
        self._liveness = Liveness(dead_after_s)
        self._admit = admit
        self._on_drop = on_drop

    async def add(self, record: WorkerRecord, *, replace: bool = False) -> Outcome:
        """Register a worker (persisted in Redis) and start ingesting and routing to it.

        The same registration again changes nothing. A different one saved under the
        worker's id (a worker restarted on new endpoints) is replaced only with
        ``replace``: its old entries are dropped and the new stream ingested.

        Returns:
            What happened: ``"created"``, ``"replaced"`` or ``"unchanged"``.

        Its models (unless the registration names them) are read from its ``GET
        /v1/models`` before this returns, so requests for them route to it at once.

        Raises:
            router.workers.registration.RegistrationError: This router's policy refuses it,
                or it is a vLLM worker whose model has no tokenizer.
            router.workers.registration.RegistrationConflict: Another registration is saved
                and ``replace`` is False.
            redis.exceptions.RedisError: Redis is unreachable; nothing was saved.
            events.errors.EventsError: Its event stream cannot be subscribed to.
            router.ingest.capacity.CapacityError: This router holds as many workers as it
                can; nothing was saved.
        """
        self._admit(record)
        wid = record.worker_id
        outcome = await self.ingest.add_worker(record, replace=replace)
        current = self._records.get(wid)
        if current is not None and current != record:
            self._drop_worker(wid)
        self._liveness.forget(wid)
        self._set_worker(record)
        await self.poller.read_models(wid)
        return outcome

    async def remove(self, worker_id: WorkerId) -> bool:
        """Unregister a worker and drop its entries; False when it was not registered."""
        known = worker_id in self._records or self._liveness.is_retired(worker_id)
        saved = await self.ingest.remove_worker(worker_id)
        self._liveness.forget(worker_id)
        self._drop_worker(worker_id)
        return known or saved

    def _set_worker(self, record: WorkerRecord) -> None:
        wid = record.worker_id
        self._records[wid] = record
        self._view.changed()
        self.poller.set_worker(wid, record.http_url, models=not record.models)

    def _drop_worker(self, worker_id: WorkerId) -> None:
        self._records.pop(worker_id, None)
        self._view.changed()
        self.poller.set_worker(worker_id, None)
        self._on_drop(worker_id)

    async def sync(self) -> None:
        """Adopt registrations made by other replicas (through Redis), when the registry
        changed since the last pass.

        NOTE: a worker missing from Redis is kept: Redis may have restarted empty, and the
        ingest registers its workers again on its next pass.
        """
        for record in await self._registry_watch.changed() or ():
            wid = record.worker_id
            if self._records.get(wid) != record and not self._liveness.is_retired(wid):
                self._set_worker(record)

    async def maintain_once(self) -> None:
        """Sync the worker set, retire dead workers, revive returning ones."""
        with contextlib.suppress(*INDEX_ERRORS):
            await self.sync()
        live = self._liveness
        for wid in live.overdue(list(self._records), self.poller.is_reachable, time.monotonic()):
            record = self._records[wid]
            logger.warning("worker %s unreachable for %.0fs: dropping it", wid, live.dead_after_s)
            with contextlib.suppress(*INDEX_ERRORS):
                await self.remove(wid)
                live.retire(record)
        for record in live.retired:
            wid = record.worker_id
            if record.http_url and await self.poller.probe(record.http_url):
                logger.info("worker %s answers again: registering it", wid)
                try:
                    await self.add(record)  # no longer retired
                except RegistrationError as exc:  # registered anew meanwhile, or refused
                    logger.info("worker %s stays unregistered: %s", wid, exc)
                    live.forget(wid)
                except INDEX_ERRORS:
                    pass  # retried next pass
