"""A watchdog over one proxied attempt: it hangs up on a worker that went silent and dead.

Silence alone proves nothing: a worker computes a long prompt's prefill before its first
byte, and a non-streamed completion arrives whole at the end. So after ``window_s``
without a byte the watchdog asks the worker whether it is alive (the caller's probe, a
``GET /health``); only a worker that does not answer either is given up. The request's
deadline is enforced the same way. Giving up calls ``hang_up``, which makes the attempt's
pending read fail, so the proxy handles it on its ordinary error path.

A probe that gets no answer condemns the worker, not only this attempt: ``on_dead`` hears
the verdict and when the failed probe began, so the caller can give up the worker's other
attempts that have not heard from it since (:meth:`SilenceWatchdog.condemn`) instead of
letting each wait out its own silence window.

Invariants: at most one timer and one probe per watchdog; nothing runs after
:meth:`SilenceWatchdog.stop`; :attr:`SilenceWatchdog.verdict` is set once, before
``hang_up`` is called.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["SilenceWatchdog"]


class SilenceWatchdog:
    """Watches one attempt for silence and for the request's deadline.

    Args:
        window_s: Silence after which the worker is probed.
        deadline: Loop time by which the whole request must be done.
        probe: Whether the worker answers at all (within ``probe_timeout_s``).
        probe_timeout_s: The probe's own timeout (for the verdict's wording).
        total_timeout_s: The request's total timeout (for the verdict's wording).
        hang_up: Ends the attempt; may be replaced as the attempt goes on (assign
            :attr:`hang_up`).
        on_dead: Hears this watchdog's verdict that the worker is unreachable, and the
            loop time its failed probe began.

    Attributes:
        verdict: Why the worker was given up (None while it is not).
        unreachable: The worker was given up as silent and not answering the probe.
        timed_out: The deadline passed.
    """

    def __init__(
        self,
        *,
        window_s: float,
        deadline: float,
        probe: Callable[[], Awaitable[bool]],
        probe_timeout_s: float,
        total_timeout_s: float,
        hang_up: Callable[[], object],
        on_dead: Callable[[str, float], None] | None = None,
    ) -> None:
        self.hang_up = hang_up
        self._on_dead = on_dead
        self.verdict: str | None = None
        self.unreachable = False
        self.timed_out = False
        self._window_s = window_s
        self._deadline = deadline
        self._probe_worker = probe
        self._probe_timeout_s = probe_timeout_s
        self._total_timeout_s = total_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._probe: asyncio.Task[None] | None = None
        self._timer = self._arm()

    def heard(self) -> None:
        """The worker sent something (the hot path's whole cost: one clock read)."""
        self._last = self._loop.time()

    def check_now(self, silent_for_s: float) -> None:
        """Probe the worker now, before the window ends, if nothing came from it for
        ``silent_for_s`` (someone else found it silent); a probe in flight is enough."""
        if self.verdict is not None or (self._probe is not None and not self._probe.done()):
            return
        now = self._loop.time()
        if now - self._last >= silent_for_s:
            self._timer.cancel()
            silence = f"silent for {now - self._last:.1f} s (its health poll unanswered)"
            self._probe = asyncio.ensure_future(self._probe_after_silence(now, silence))

    def condemn(self, verdict: str, since: float) -> None:
        """Another attempt's probe, begun at loop time ``since``, got no answer from the
        worker: give this attempt up too, unless it heard from the worker after that."""
        if self.verdict is None and self._last <= since:
            self.unreachable = True
            self._give_up(verdict)

    def stop(self) -> None:
        """The attempt is over."""
        self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()

    def _arm(self) -> asyncio.TimerHandle:
        return self._loop.call_at(min(self._last + self._window_s, self._deadline), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._deadline:
            self.timed_out = True
            self._give_up(
                f"no complete answer within the total timeout ({self._total_timeout_s:g} s)"
            )
        elif now < self._last + self._window_s:
            self._timer = self._arm()  # heard from it meanwhile
        else:
            self._probe = asyncio.ensure_future(self._probe_after_silence(now))

    async def _probe_after_silence(self, since: float, silence: str | None = None) -> None:
        """Probe the worker, silent since before ``since`` (``silence`` says how, for the
        verdict; the window by default); give it up if it does not answer."""
        alive = await self._probe_worker()
        if alive or self._last > since:  # it answered, or spoke meanwhile
            if alive:
                self._last = max(self._last, self._loop.time())
            self._timer = self._arm()
            return
        if self.verdict is not None:  # condemned meanwhile
            return
        self.unreachable = True
        silence = silence or f"silent for {self._window_s:g} s"
        verdict = f"{silence} and no answer to GET /health within {self._probe_timeout_s:g} s"
        self._give_up(verdict)
        if self._on_dead is not None:
            self._on_dead(verdict, since)

    def _give_up(self, verdict: str) -> None:
        self.verdict = verdict
        self.hang_up()
