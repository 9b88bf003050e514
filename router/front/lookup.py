"""Index reads on the routing path, in degraded mode when Redis fails: a request never does.

When the index lookup fails (Redis unreachable or slow), the decision is made without
cached prefixes, i.e. on load (and predicted entries) alone: :attr:`IndexLookup.live`
turns False (``/health`` says ``"index": "degraded"``, the ``kvroute_router_index_live``
gauge drops to 0). A lookup is retried at most once per ``probe_interval_s`` until one
succeeds; the ingest rebuilds the index by itself when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Final

from redis.exceptions import RedisError

from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.front.metrics import RouterMetrics
from router.index.base import PrefixIndex, PrefixMatch
from router.routing.request_keys import RequestKeys, rescale

__all__ = ["INDEX_ERRORS", "IndexLookup"]

logger = logging.getLogger(__name__)

INDEX_ERRORS: Final = (RedisError, OSError, PrefixIndexError, asyncio.TimeoutError)
"""What a failing or slow Redis raises on the routing path (handled, never a 5xx)."""


class IndexLookup:
    """Looks up a request's cached prefixes, or answers ``{}`` while the index is down.

    Args:
        index: The index, on a client that fails fast (its socket timeout bounds a lookup).
        metrics: Where ``index_live`` and ``index_errors`` go.
        probe_interval_s: While degraded, the least time between two lookup attempts.
    """

    def __init__(
        self, index: PrefixIndex, metrics: RouterMetrics, probe_interval_s: float
    ) -> None:
        self._index = index
        self._metrics = metrics
        self._probe_interval_s = probe_interval_s
        self._live = True
        self._next_probe = 0.0

    @property
    def live(self) -> bool:
        """False while routing is degraded to load only."""
        return self._live

    async def matches(self, request: RequestKeys) -> Mapping[WorkerId, PrefixMatch]:
        """Index matches in blocks of ``request.base`` tokens, each block-size group looked
        up with its own keys in one round trip (possibly also holders that are not
        candidates); {} while degraded."""
        now = time.monotonic()
        if not self._live and now < self._next_probe:
            return {}
        base, groups = request.base, request.groups
        out: dict[WorkerId, PrefixMatch] = {}
        try:
            for size, members in groups.items():
                # Bounded by the fast client's socket timeout (lookup_timeout_s); no
                # wait_for, which would cost a task per decision. With one block size
                # the family's holders are read instead of sending every candidate's id
                # (fewer bytes, no HMGET); holders that are not candidates are ignored
                # by build_candidates.
                asked = None if len(groups) == 1 else members
                found = await self._index.lookup(request.keys[size], asked)
                for wid, match in found.items():
                    out[wid] = match if size == base else rescale(match, size, base)
        except Exception as exc:  # whatever the index does, it never causes a 5xx
            self._metrics.index_errors.labels("lookup").inc()
            self._next_probe = now + self._probe_interval_s
            if not isinstance(exc, INDEX_ERRORS):
                logger.exception("index lookup raised unexpectedly; routing on load only")
            elif self._live:
                logger.warning(
                    "index lookup failed (%s); routing on load only until it answers", exc
                )
            self._set_live(False)
            return {}
        if not self._live:
            logger.info("index lookup answers again; cache-aware routing resumed")
        self._set_live(True)
        return out

    def _set_live(self, live: bool) -> None:
        self._live = live
        self._metrics.index_live.set(1 if live else 0)

