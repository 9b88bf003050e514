"""Periodic: a background step repeated at a fixed interval until stopped.

Stopping sets an event instead of cancelling the task: a client library may swallow a
cancellation that lands inside one of its calls (seen with Python 3.11's
``asyncio.timeout`` when the cancel and the deadline coincide, which the client then
reports as its own timeout error) and leave a cancelled loop running forever, and
whoever awaits it hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

__all__ = ["Periodic"]

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0
"""How long :meth:`Periodic.stop` waits for a step in flight before cancelling it."""


class Periodic:
    """Runs ``step`` every ``interval_s`` in a background task until :meth:`stop`.

    A step that raises is logged and the loop goes on (a loop that died silently would
    freeze whatever it keeps fresh).

    Args:
        step: The coroutine function run each period.
        interval_s: Pause between the end of one step and the start of the next.
    """

    def __init__(self, step: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self._step = step
        self._interval_s = interval_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, name: str, *, wait_first: bool = False) -> None:
        """Start the loop (``wait_first``: one interval before the first step)."""
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(wait_first), name=name)

    async def stop(self) -> None:
        """Stop after the step in flight, if any (cancelled past a timeout)."""
        if self._task is None:
            return
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=_STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("periodic task %s did not stop in time; cancelling it", self._task)
            self._task.cancel()
        self._task = None

    async def _run(self, wait_first: bool) -> None:
        if wait_first:
            await self._pause()
        while not self._stopping.is_set():
            try:
                await self._step()
            except Exception:
                log.exception("periodic task %s failed; retrying", self._step)
            await self._pause()

    async def _pause(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), self._interval_s)
