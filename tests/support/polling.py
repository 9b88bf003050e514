"""Polling with a deadline: the one way tests wait for state that offers no event.

Wait on an event (an ``asyncio.Event``, a socket, a process exit) where there is one; poll
only what another task, thread or process changes without telling (its metrics, a TTL, a
file it writes). :func:`wait_until` blocks the calling thread; :func:`eventually` is its
asyncio form. Both check at once, then again after pauses that grow from 5 ms to 100 ms
(fast when the state is nearly there, gentle on a loaded 2-core machine when it is not),
and fail with an ``AssertionError`` naming what was awaited and how long it was awaited.
Deadlines are generous on purpose: a poll that ends early proves nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 30.0
"""The deadline when a test names none."""
FIRST_PAUSE_S = 0.005
MAX_PAUSE_S = 0.1

What = str | Callable[[], str]
"""What is awaited, for the failure message; a callable is asked at the deadline (to report
the last state seen)."""


def _timed_out(what: What, timeout_s: float, waited_s: float) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"waited {waited_s:.1f} s (limit {timeout_s:g} s) for {text}")


def wait_until(
    check: Callable[[], bool],
    what: What,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poke: Callable[[], object] | None = None,
) -> float:
    """Call ``check`` until it returns true.

    Args:
        check: The condition; called at once and after each pause.
        what: What is awaited, as the failure message names it.
        timeout_s: Fail once this many seconds passed without ``check`` holding.
        poke: Called after each failed check (e.g. publish a probe batch).

    Returns:
        The seconds it took.

    Raises:
        AssertionError: ``timeout_s`` passed first.
    """
    start = time.monotonic()
    pause_s = FIRST_PAUSE_S
    while not check():
        waited_s = time.monotonic() - start
        if waited_s >= timeout_s:
            raise _timed_out(what, timeout_s, waited_s)
        if poke is not None:
            poke()
        time.sleep(min(pause_s, timeout_s - waited_s))
        pause_s = min(2 * pause_s, MAX_PAUSE_S)
    return time.monotonic() - start


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    what: What,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poke: Callable[[], object] | None = None,
) -> float:
    """Await ``check`` until it holds; the asyncio form of :func:`wait_until`.

    Args:
        check: The condition, returning a bool or an awaitable of one.
        what: What is awaited, as the failure message names it.
        timeout_s: Fail once this many seconds passed without ``check`` holding.
        poke: Called after each failed check.

    Returns:
        The seconds it took.

    Raises:
        AssertionError: ``timeout_s`` passed first.
    """
    start = time.monotonic()
    pause_s = FIRST_PAUSE_S
    while not await _held(check):
        waited_s = time.monotonic() - start
        if waited_s >= timeout_s:
            raise _timed_out(what, timeout_s, waited_s)
        if poke is not None:
            poke()
        await asyncio.sleep(min(pause_s, timeout_s - waited_s))
        pause_s = min(2 * pause_s, MAX_PAUSE_S)
    return time.monotonic() - start


async def _held(check: Callable[[], bool | Awaitable[bool]]) -> bool:
    held = check()
    return bool(await held) if inspect.isawaitable(held) else bool(held)
