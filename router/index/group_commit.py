"""Group commit of index writes: a store wrapper under which, while one write is in flight,
every later change joins the next.

The ingest folds batches as fast as they arrive; waiting for the store after each one caps
it at one round trip per batch, and a round trip per worker costs more client time than
the write itself when many workers are busy. :class:`GroupCommitIndex` wraps any
``PrefixIndex`` store: a batch is folded straight into its worker's pending changes
(:meth:`GroupCommit.queued`: per router key the first old mask, the latest new mask) and
one background task hands the pending sets of *all* workers to the store's ``write_many``
in one call whenever the previous one completed.

Invariants: at most one ``write_many`` is in flight, so per worker, writes land in order; a
worker whose write failed loses its pending changes too (they were folded on top of the
lost write: the caller rebuilds the worker); the failure goes to ``on_error`` when one is
given, else it is kept and raised once by the next ``queued`` or ``flush`` of that worker.
A lookup reads the store as it is (queued changes not yet in it); a read of one worker's
entries, a clear and ``stats`` wait for the queued writes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from events.cancellation import cancel_and_wait
from events.hashing import BlockKey
from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.index.base import IndexStats, PrefixIndex, PrefixMatch
from router.index.changes import Changes

__all__ = ["GroupCommit", "GroupCommitIndex", "Send"]

log = logging.getLogger(__name__)

Send = Callable[[dict[WorkerId, Changes]], Awaitable[Mapping[WorkerId, Exception]]]
"""Writes the changes of several workers; returns the failure of each worker that failed
(raising fails them all): a store's ``write_many``."""


class GroupCommit:
    """A write-behind queue for all workers in front of a ``send`` coroutine.

    Args:
        send: Writes the pending changes of several workers (see :data:`Send`).
        on_error: Told of a worker's failed write at once (instead of the next call
            raising it).
    """

    def __init__(
        self, send: Send, on_error: Callable[[WorkerId, Exception], None] | None = None
    ) -> None:
        self._send = send
        self._on_error = on_error
        self._pending: dict[WorkerId, Changes] = {}
        self._in_flight: frozenset[WorkerId] = frozenset()
        self._errors: dict[WorkerId, Exception] = {}
        self._task: asyncio.Task[None] | None = None
        self._progress = asyncio.Event()

    def queued(self, worker_id: WorkerId) -> Changes:
        """The worker's pending changes, to fold more changes into in place (then call
        :meth:`send_soon`); valid until the caller's next ``await``, after which the
        sender may have taken them.

        Raises:
            Exception: The previous write of this worker failed (raised once).
        """
        error = self._errors.pop(worker_id, None)
        if error is not None:
            raise error
        pending = self._pending.get(worker_id)
        if pending is None:
            pending = self._pending[worker_id] = Changes()
        return pending

    def holds(self, worker_id: WorkerId, changes: Changes) -> bool:
        """Whether ``changes`` are the worker's pending ones (from :meth:`queued`, not yet
        taken by the sender)."""
        return self._pending.get(worker_id) is changes

    def send_soon(self) -> None:
        """Start the sender unless it is running (it sends whatever is pending)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        while self._pending:
            # A worker's folded batches may have changed nothing: no write for it.
            writes = {worker_id: changes for worker_id, changes in self._pending.items() if changes}
            self._pending = {}
            if not writes:
                continue
            self._in_flight = frozenset(writes)
            try:
                failed = await self._send(writes)
            except Exception as exc:  # every worker of the write failed
                failed = dict.fromkeys(writes, exc)
            finally:
                self._in_flight = frozenset()
            for worker_id, error in failed.items():
                self._fail(worker_id, error)
            self._progress.set()
            self._progress = asyncio.Event()

    def _fail(self, worker_id: WorkerId, exc: Exception) -> None:
        self._pending.pop(worker_id, None)
        if self._on_error is not None:
            self._on_error(worker_id, exc)  # which says what it makes of it
        else:
            log.warning("worker %s: queued index write failed: %s", worker_id, exc)
            self._errors[worker_id] = exc

    def _busy(self, ids: Iterable[WorkerId]) -> bool:
        running = self._task is not None and not self._task.done()
        return running and any(w in self._pending or w in self._in_flight for w in ids)

    async def flush(self, worker_id: WorkerId | None = None, *, raise_errors: bool = True) -> None:
        """Wait until the worker's (or every worker's) queued changes are written.

        Raises:
            Exception: A queued write failed (when ``raise_errors``; else it is dropped).
        """
        everyone = [*self._pending, *self._in_flight, *self._errors]
        ids = everyone if worker_id is None else [worker_id]
        if any(self._pending.get(w) for w in ids):
            # Folded into but not sent on (a fold that raised half-way): written now, so
            # nothing queued lands after what the caller does next (say, a clear).
            self.send_soon()
        while self._busy(ids):
            await self._progress.wait()
        errors = [e for w in ids if (e := self._errors.pop(w, None)) is not None]
        if errors and raise_errors:
            raise errors[0]

    def discard(self, worker_id: WorkerId) -> None:
        """Drop the worker's queued changes and error (a write in flight still completes)."""
        self._pending.pop(worker_id, None)
        self._errors.pop(worker_id, None)

    async def close(self) -> None:
        """Cancel the sender (queued changes are lost)."""
        if self._task is not None:
            await cancel_and_wait([self._task])
        self._pending.clear()
        self._errors.clear()
        self._progress.set()


class GroupCommitIndex:
    """A ``PrefixIndex`` that commits the writes of all workers in groups to a wrapped store.

    ``write`` only queues the changes (got from :meth:`changes_for`: the worker's queued
    ones) and returns; the queued changes of every worker go to the store in one
    ``write_many`` while the previous one is in flight. A failed write is reported to
    ``on_error``, or raised by the worker's next :meth:`changes_for` or :meth:`flush`.

    Args:
        store: Where the changes are written and read.
        on_error: Told of a worker's failed queued write at once (its queued changes are
            lost: the caller rebuilds the worker).
    """

    def __init__(
        self, store: PrefixIndex, on_error: Callable[[WorkerId, Exception], None] | None = None
    ) -> None:
        self.store = store
        self._queues = GroupCommit(store.write_many, on_error)

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (see ``PrefixIndex.use_lease``)."""
        self.store.use_lease(worker_id, token)

    def forget_lease(self, worker_id: WorkerId) -> None:
        """Stop writing for the worker and drop its queued writes (one in flight completes)."""
        self.store.forget_lease(worker_id)
        self._queues.discard(worker_id)

    def changes_for(self, worker_id: WorkerId) -> Changes:
        """The worker's queued changes (see ``PrefixIndex.changes_for``).

        Raises:
            PrefixIndexError: The store does not write for the worker (no lease given).
            Exception: The worker's previous write failed (raised once).
        """
        self.store.changes_for(worker_id)  # the store's own checks (its lease)
        return self._queues.queued(worker_id)

    async def write(self, worker_id: WorkerId, changes: Changes) -> None:
        """Send the worker's queued changes soon (see ``PrefixIndex.write``).

        Raises:
            PrefixIndexError: ``changes`` are not the worker's queued ones.
        """
        if not self._queues.holds(worker_id, changes):
            # Others would be dropped unwritten: refuse them instead.
            raise PrefixIndexError(
                f"changes for worker {worker_id!r} are not its queued ones: with group "
                "commit, fold into what changes_for() gives and write it before any await"
            )
        self._queues.send_soon()

    async def write_many(self, writes: Mapping[WorkerId, Changes]) -> dict[WorkerId, Exception]:
        """Queue several workers' changes got from :meth:`changes_for` (see
        ``PrefixIndex.write_many``); a failure comes later, as for :meth:`write`."""
        failed: dict[WorkerId, Exception] = {}
        for worker_id, changes in writes.items():
            try:
                await self.write(worker_id, changes)
            except PrefixIndexError as exc:
                failed[worker_id] = exc
        return failed

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Wait until the queued writes of a worker (or all) are in the store.

        Raises:
            Exception: A queued write failed (e.g. ``StaleLeaseError``: the lease is lost).
        """
        await self._queues.flush(worker_id)

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """The store's longest held prefix per candidate; queued changes are not seen."""
        return await self.store.lookup(keys, workers)

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker once its queued writes landed (see
        ``PrefixIndex.clear_worker``)."""
        # A failure among them is moot: the worker is emptied.
        await self._queues.flush(worker_id, raise_errors=False)
        await self.store.clear_worker(worker_id)

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker once its queued writes landed (a failed one dropped)."""
        await self._queues.flush(worker_id, raise_errors=False)
        return await self.store.worker_entries(worker_id)

    async def stats(self) -> IndexStats:
        """The store's sizes once every queued write landed (a failed one dropped)."""
        await self._queues.flush(raise_errors=False)
        return await self.store.stats()

    async def close(self) -> None:
        """Stop the sender (queued writes are dropped), then the store."""
        await self._queues.close()
        await self.store.close()
