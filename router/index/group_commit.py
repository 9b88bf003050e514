"""Group commit of index writes: while one write is in flight, every later change joins the next.

The ingest folds batches as fast as they arrive; waiting for Redis after each one caps it
at one round trip per batch, and a round trip per worker costs more client time than
the write itself when many workers are busy. With group commit a batch is folded straight
into its worker's pending changes (:meth:`GroupCommit.queued`: per router key the first
old mask, the latest new mask) and one background task sends the pending sets of *all*
workers in one ``send`` call whenever the previous one completed.

Invariants: at most one ``send`` is in flight, so per worker, writes land in order; a
worker whose write failed loses its pending changes too (they were folded on top of the
lost write: the caller rebuilds the worker); the failure goes to ``on_error`` when one is
given, else it is kept and raised once by the next ``queued`` or ``flush`` of that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from events.identity import WorkerId
from router.index.changes import Changes

__all__ = ["GroupCommit", "Send"]

log = logging.getLogger(__name__)

Send = Callable[[dict[WorkerId, Changes]], Awaitable[dict[WorkerId, Exception]]]
"""Writes the changes of several workers; returns the failure of each worker that failed
(raising fails them all)."""


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
        self.on_error = on_error
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
        if self.on_error is not None:
            self.on_error(worker_id, exc)  # which says what it makes of it
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
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._pending.clear()
        self._errors.clear()
        self._progress.set()
