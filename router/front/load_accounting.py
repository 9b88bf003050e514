"""Load accounting of routed requests: what each one adds to and removes from a worker.

The service hands a :class:`LoadAccounting` to the proxy as the attempt observer of each
request it forwards; a ``/v1/route`` decision, whose request the client forwards itself,
counts for a while through :class:`RouteHolds`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from events.identity import WorkerId
from router.front.proxy_contracts import AttemptOutcome, ProxyTarget
from router.load.model import finished, prefilled, routed
from router.load.shared import RedisLoadTracker

if TYPE_CHECKING:
    from router.front.decisions import Routed
    from router.front.service import RouterService

__all__ = ["LoadAccounting", "RouteHolds"]


class LoadAccounting:
    """Accounts one forwarded request's load on each worker it is sent to.

    Routed load is added when an attempt starts, its prefill leaves the queue at the first
    byte of the answer, and the rest when the attempt ends (a failed attempt leaves no
    load behind). Local figures change at once; Redis hears of it without delaying the
    request. Implements :class:`router.front.proxy_contracts.AttemptObserver`.
    """

    def __init__(self, service: RouterService, routed_: Routed) -> None:
        self._service = service
        self._routed = routed_
        self._prefilled: set[WorkerId] = set()

    async def attempt_started(self, target: ProxyTarget) -> None:
        """Add the request's load to ``target`` (a retry also moves the prefix credit)."""
        if target.worker_id != self._routed.decision.worker_id:
            self._service.credit(target.worker_id, self._routed.keys.of(target.worker_id))
        prefill = self._routed.prefill_of(target.worker_id)
        self._service.load.add_nowait(
            target.worker_id, routed(prefill, self._routed.num_output_tokens)
        )

    async def first_byte(self, target: ProxyTarget) -> None:
        """The prefill is done: it leaves ``target``'s queue."""
        self._prefilled.add(target.worker_id)
        self._service.load.add_nowait(
            target.worker_id, prefilled(self._routed.prefill_of(target.worker_id))
        )

    async def attempt_ended(self, target: ProxyTarget, outcome: AttemptOutcome) -> None:
        """Remove the rest of the request's load and count the attempt by outcome (the
        worker's circuit heard of it from the proxy)."""
        wid = target.worker_id
        delta = finished(self._routed.num_output_tokens)
        if wid not in self._prefilled:
            delta = delta + prefilled(self._routed.prefill_of(wid))
        self._service.load.add_nowait(wid, delta)
        self._service.metrics.proxy_attempts.labels(wid, outcome).inc()


class RouteHolds:
    """``/v1/route`` decisions counted as load on their worker for a while.

    Args:
        load: The shared in-flight load.
        hold_s: How long a decision counts.
    """

    def __init__(self, load: RedisLoadTracker, hold_s: float) -> None:
        self._load = load
        self._hold_s = hold_s
        self._holds: set[asyncio.TimerHandle] = set()

    def hold(self, routed_: Routed) -> None:
        """Count a decision as load on its worker for ``hold_s``."""
        wid = routed_.decision.worker_id
        prefill = routed_.prefill_of(wid)
        self._load.add_nowait(wid, routed(prefill, routed_.num_output_tokens))
        release = prefilled(prefill) + finished(routed_.num_output_tokens)

        def expire() -> None:
            self._holds.discard(handle)
            self._load.add_nowait(wid, release)

        # A timer, not a sleeping task per decision: /v1/route is the hot path.
        handle = asyncio.get_running_loop().call_later(self._hold_s, expire)
        self._holds.add(handle)

    def cancel(self) -> None:
        """Cancel every pending release."""
        for handle in self._holds:
            handle.cancel()
        self._holds.clear()
