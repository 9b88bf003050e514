"""Group commit of index writes: while one worker's write is in flight, later changes merge.

The ingest folds a worker's batches as fast as they arrive; waiting for Redis after each
one caps it at one round trip per batch. With group commit ``submit`` returns at once:
the changes join the worker's pending set (merged per router key: the first old mask,
the latest new mask) and one background task per worker sends the pending set whenever
the previous write completed. Per worker, writes stay in order; a failed write goes to
the ``on_error`` callback when one is given, else it is kept and raised by the next
``submit`` or ``flush`` of that worker, so the caller rebuilds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.index.base import WorkerId
from router.index.bridge import Changes, EntryChange

__all__ = ["GroupCommit", "merge_changes"]

log = logging.getLogger(__name__)


def merge_changes(into: Changes, changes: Changes) -> None:
    """Fold later ``changes`` into ``into``: per key, the first old and the latest new mask."""
    for key, change in changes.items():
        previous = into.get(key)
        if previous is None:
            into[key] = change
        else:
            into[key] = EntryChange(key, change.tag, previous.old_mask, change.new_mask)


@dataclass(eq=False)
class _Queue:
    # NOTE: pending holds changes not yet handed to send; task, while running, is the
    # only sender of this worker (so writes never overtake each other).
    pending: Changes = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    error: BaseException | None = None


class GroupCommit:
    """Per-worker write-behind queues in front of a ``send(worker, changes)`` coroutine.

    Args:
        send: Writes one merged set of a worker's changes (raises on failure).
        on_error: Told of a failed write at once (instead of the next call raising it).
    """

    def __init__(
        self,
        send: Callable[[WorkerId, Changes], Awaitable[None]],
        on_error: Callable[[WorkerId, Exception], None] | None = None,
    ) -> None:
        self._send = send
        self.on_error = on_error
        self._queues: dict[WorkerId, _Queue] = {}

    def submit(self, worker_id: WorkerId, changes: Changes) -> None:
        """Queue changes for the worker; starts its sender if idle.

        Raises:
            Exception: The previous write of this worker failed (raised once).
        """
        queue = self._queues.setdefault(worker_id, _Queue())
        if queue.error is not None:
            error, queue.error = queue.error, None
            raise error
        merge_changes(queue.pending, changes)
        if queue.task is None or queue.task.done():
            queue.task = asyncio.create_task(self._drain(worker_id, queue))

    async def _drain(self, worker_id: WorkerId, queue: _Queue) -> None:
        while queue.pending:
            changes = {k: c for k, c in queue.pending.items() if c.old_mask != c.new_mask}
            queue.pending = {}
            if not changes:
                continue
            try:
                await self._send(worker_id, changes)
            except Exception as exc:  # kept for the caller: it decides how to recover
                log.warning("worker %s: queued index write failed: %s", worker_id, exc)
                queue.pending = {}
                if self.on_error is not None:
                    self.on_error(worker_id, exc)
                else:
                    queue.error = exc
                return

    async def flush(self, worker_id: WorkerId | None = None, *, raise_errors: bool = True) -> None:
        """Wait until the worker's (or every worker's) queued changes are written.

        Raises:
            Exception: A queued write failed (when ``raise_errors``; else it is dropped).
        """
        ids = list(self._queues) if worker_id is None else [worker_id]
        for wid in ids:
            queue = self._queues.get(wid)
            if queue is None:
                continue
            while queue.task is not None and not queue.task.done():
                await asyncio.shield(queue.task)
            error, queue.error = queue.error, None
            if error is not None and raise_errors:
                raise error

    def discard(self, worker_id: WorkerId) -> None:
        """Drop the worker's queued changes and error (a write in flight still completes)."""
        queue = self._queues.pop(worker_id, None)
        if queue is not None:
            queue.pending = {}

    async def close(self) -> None:
        """Cancel every sender (queued changes are lost)."""
        for queue in self._queues.values():
            if queue.task is not None:
                queue.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await queue.task
        self._queues.clear()
