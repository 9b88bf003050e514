"""Stopping asyncio tasks for good, even when a library loses the cancellation.

``task.cancel()`` then ``await task`` assumes the task ends. A library may lose the
cancellation instead: redis-py 8.1's asyncio client swallows one that lands while a
command completes (in more than half of the tries on a quick command), and the task goes
on with :meth:`asyncio.Task.cancelling` set but nothing raised, back to its loop; the
``await`` then waits for good (a router's close hung on an event reader that way).
:func:`cancel_and_wait` cancels again whatever is still running after a short grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["RECANCEL_S", "cancel_and_wait"]

RECANCEL_S: Final = 0.5
"""Grace after a cancellation before a task still running is cancelled again: a task
that honours it ends at its next ``await``; one in a longer cleanup is cut short."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again, every
    :data:`RECANCEL_S`, those a lost cancellation left running. Their results and
    exceptions are consumed (nothing is logged as never retrieved)."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        for task in done:
            if not task.cancelled():
                task.exception()
