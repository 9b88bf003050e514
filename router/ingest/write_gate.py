"""WriteGate: whether the index takes writes, shut while Redis refuses them or is unreachable.

A Redis at ``maxmemory`` with ``noeviction`` refuses every write that needs memory; a
Redis that is down (or restarting, or loading its data) fails every write. Left alone,
the ingest would turn each batch into a failed write, a resync, a snapshot fetch from the
worker and another failed write, logging each. Instead the first such failure shuts the
gate: batches are dropped (counted; their workers marked for one rebuild), no rebuild is
attempted, and one warning per interval says so. While shut, Redis is probed at a backoff
(``INFO memory``); once every node answers with room (no ``maxmemory``, or some headroom
below it: a Redis at the edge takes a small write now and then, which is no reason to
rebuild), the gate opens and each marked worker is rebuilt once.

The state shows as ``kvroute_index_writable`` (1 or 0) and
``kvroute_index_write_errors_total{reason}`` (``oom``, ``unreachable``) in ``/metrics``, and
in the router's ``/health``.
"""

from __future__ import annotations

import logging
import time

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from events.rate_limited_log import RateLimitedLog
from router.ingest.metrics import IngestMetrics
from router.store.connection import RedisClient

__all__ = ["WriteGate", "shut_reason"]

log = logging.getLogger(__name__)

_HEADROOM = 0.05
"""Share of ``maxmemory`` that must be free before writes are tried again."""


def shut_reason(exc: BaseException) -> str | None:
    """Why a failed write shuts the gate: ``"oom"`` (out of memory), ``"unreachable"``
    (no connection, no answer, still loading its data), or None for a failure of that one
    write (a lost lease, a script error), which the worker's own rebuild handles."""
    if isinstance(exc, OutOfMemoryError):  # maxmemory with noeviction
        return "oom"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return "unreachable"
    return None


_WARNINGS: dict[str, str] = {
    "oom": "Redis is out of memory (%s, on %s); dropping batches and retrying every %.0f s "
    "at most; raise Redis's maxmemory or free memory",
    "unreachable": "Redis is unreachable (%s, on %s); dropping batches and retrying every "
    "%.0f s at most; each worker is rebuilt once when it answers",
}


class WriteGate:
    """Open while the index takes writes; shut after a write fails for a reason that
    fails every write (see :func:`shut_reason`) until a probe finds Redis answering with
    room.

    Args:
        client: The Redis client the ingest writes with (the probe goes through it).
        metrics: Where the gauge and the error counter go.
        retry_s: The first wait before a probe; it doubles with each failed probe.
        retry_max_s: The longest wait between two probes.
        log_interval_s: The least time between two warnings while shut.
    """

    def __init__(
        self,
        client: RedisClient,
        metrics: IngestMetrics,
        *,
        retry_s: float = 1.0,
        retry_max_s: float = 10.0,
        log_interval_s: float = 10.0,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self._warn = RateLimitedLog(log_interval_s, log)
        # NOTE: while shut, the backoff of the next probe and when it is due (monotonic);
        # meaningless while open.
        self._is_open = True
        self._backoff_s = retry_s
        self._probe_at = 0.0
        self._opened_at = 0.0
        self._reason: str | None = None
        metrics.writable.set(1)

    @property
    def is_open(self) -> bool:
        """Whether the index takes writes (a cheap check, made per batch)."""
        return self._is_open

    @property
    def is_full(self) -> bool:
        """Shut because Redis is out of memory (not merely unreachable)."""
        return not self._is_open and self._reason == "oom"

    def refused(self, exc: BaseException, what: str) -> None:
        """A write (``what``, for the log) failed for a reason ``shut_reason`` names: shut
        the gate, or keep it shut; warn at most once per interval and reason."""
        reason = shut_reason(exc) or "unreachable"
        self._metrics.write_errors.labels(reason).inc()
        self._reason = reason
        if self._is_open:
            now = time.monotonic()
            self._is_open = False
            if now - self._opened_at > self._retry_max_s:
                self._backoff_s = self._retry_s
            else:  # refused again soon after it opened: keep backing off
                self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)
            self._probe_at = now + self._backoff_s
            self._metrics.writable.set(0)
        self._warn.warning(
            ("index", reason), "index writes refused: " + _WARNINGS[reason], exc, what,
            self._retry_max_s,
        )  # fmt: skip

    async def probe(self) -> bool:
        """While shut and a probe is due, read Redis's memory; open when it answers with room.

        Returns:
            Whether the gate is open now.

        Raises:
            redis.exceptions.RedisError: Redis failed (unreachable, say); the next probe
                waits for the backoff.
        """
        if self._is_open or time.monotonic() < self._probe_at:
            return self._is_open
        self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)
        self._probe_at = time.monotonic() + self._backoff_s
        if not all(_has_room(info) for info in await self._memory()):
            return False
        self._is_open = True
        self._opened_at = time.monotonic()
        self._metrics.writable.set(1)
        log.info("index writes accepted again: Redis answers with room; rebuilding the "
                 "workers whose batches were dropped")  # fmt: skip
        return True

    async def _memory(self) -> list[dict[str, object]]:
        """``INFO memory`` of every primary."""
        if isinstance(self._client, RedisCluster):
            info = await self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            return list(info.values())
        return [await self._client.info("memory")]


def _has_room(info: dict[str, object]) -> bool:
    limit = int(str(info.get("maxmemory", 0)))
    return limit == 0 or int(str(info.get("used_memory", 0))) < limit * (1 - _HEADROOM)
