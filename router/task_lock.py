"""TaskLock: an asyncio lock that the task holding it may take again.

The ingest serialises everything that changes one worker's entries (a batch, a reset, a
resync, a maintenance step) with one of these; a recovery path that runs inside a batch
(a replay redelivers batches to the same task) takes it again without deadlocking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["TaskLock"]


class TaskLock:
    """Mutual exclusion between tasks, re-entrant within the task that holds it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        # NOTE: the task inside the outermost hold(), None when free.
        self._holder: asyncio.Task[object] | None = None

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the lock for the ``async with`` body; nested holds by one task pass through."""
        task = asyncio.current_task()
        if self._holder is not None and self._holder is task:
            yield
            return
        async with self._lock:
            self._holder = task
            try:
                yield
            finally:
                self._holder = None
