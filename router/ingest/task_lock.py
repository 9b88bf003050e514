"""TaskLock: an asyncio lock that the task holding it may take again, or set down for a while.

The ingest serialises everything that changes one worker's entries (a batch, a reset, a
resync, a maintenance step) with one of these; a recovery path that runs inside a batch
(a replay redelivers batches to the same task) takes it again without deadlocking, and
sets it down while it waits on the network (:meth:`TaskLock.released`).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["TaskLock"]


class TaskLock:
    """Mutual exclusion between tasks, re-entrant within the task that holds it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        # NOTE: the task inside the outermost hold(), None when free (or set down by
        # released()); an outer hold releases the lock only while its task is the holder.
        self._holder: asyncio.Task[object] | None = None

    @property
    def is_held(self) -> bool:
        """Whether some task holds the lock now (a cheap check; it may change at the
        next ``await``)."""
        return self._lock.locked()

    def hold(self) -> _Hold:
        """Hold the lock for the ``async with`` body; nested holds by one task pass through."""
        return _Hold(self)

    def released(self) -> _Released:
        """Set the lock down for the ``async with`` body, from inside the holder's hold:
        other tasks may take it meanwhile, and it is taken again on the way out (not
        after a cancellation: then the outer hold, no longer the holder, leaves it).
        Outside a hold of the current task it does nothing."""
        return _Released(self)


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
        lock = self._lock
        if self._outer and lock._holder is asyncio.current_task():
            lock._holder = None
            lock._lock.release()


class _Released:
    """One ``async with lock.released()``."""

    __slots__ = ("_lock", "_task")

    def __init__(self, lock: TaskLock) -> None:
        self._lock = lock
        self._task: asyncio.Task[object] | None = None

    async def __aenter__(self) -> None:
        lock = self._lock
        task = asyncio.current_task()
        if task is None or lock._holder is not task:
            return
        self._task = task
        lock._holder = None
        lock._lock.release()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is None or exc_type is asyncio.CancelledError:
            return
        await self._lock._lock.acquire()
        self._lock._holder = self._task
