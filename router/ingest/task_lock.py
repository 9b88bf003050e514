"""TaskLock: an asyncio lock that the task holding it may take again.

The ingest serialises everything that changes one worker's entries (a batch, a reset, a
resync, a maintenance step) with one of these; a recovery path that runs inside a batch
(a replay redelivers batches to the same task) takes it again without deadlocking.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["TaskLock"]


class TaskLock:
    """Mutual exclusion between tasks, re-entrant within the task that holds it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        # NOTE: the task inside the outermost hold(), None when free.
        self._holder: asyncio.Task[object] | None = None

    def hold(self) -> _Hold:
        """Hold the lock for the ``async with`` body; nested holds by one task pass through."""
        return _Hold(self)


class _Hold:
    """One ``async with lock.hold()`` (a plain class: the ingest takes one per batch, and
    a generator-based context manager costs several times as much)."""

    __slots__ = ("_lock", "_outer")

    def __init__(self, lock: TaskLock) -> None:
        self._lock = lock
        self._outer = False

    async def __aenter__(self) -> None:
        lock = self._lock
        task = asyncio.current_task()
        if lock._holder is not None and lock._holder is task:
            return  # nested in the holder's own hold: passes through
        await lock._lock.acquire()
        lock._holder = task
        self._outer = True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._outer:
            self._lock._holder = None
            self._lock._lock.release()
