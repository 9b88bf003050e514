"""WriteGate: whether the index takes writes, shut while Redis refuses them for lack of memory.

A Redis at ``maxmemory`` with ``noeviction`` refuses every write that needs memory. Left
alone, the ingest would turn each batch into a failed write, a resync, a snapshot fetch
and another failed write, logging each. Instead the first refusal shuts the gate: batches
are dropped (counted; their workers marked for one rebuild), no rebuild is attempted, and
one warning per interval says so. While shut, Redis's memory is probed at a backoff; once
every node has room again (no ``maxmemory``, or some headroom below it: a Redis at the
edge takes a small write now and then, which is no reason to rebuild), the gate opens
and each marked worker is rebuilt once.

The state shows as ``kvroute_index_writable`` (1 or 0) and
``kvroute_index_write_errors_total{reason}`` in ``/metrics``, and in the router's ``/health``.
"""

from __future__ import annotations

import logging
import time

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError

from events.rate_limited_log import RateLimitedLog
from router.ingest.metrics import IngestMetrics
from router.store.connection import RedisClient

__all__ = ["WriteGate", "is_out_of_memory"]

log = logging.getLogger(__name__)

_HEADROOM = 0.05
"""Share of ``maxmemory`` that must be free before writes are tried again."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write for lack of memory (``maxmemory``)."""
    return isinstance(exc, OutOfMemoryError)


class WriteGate:
    """Open while the index takes writes; shut after a refusal for lack of memory.

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
        self._errors = metrics.write_errors.labels("oom")
        metrics.writable.set(1)

    @property
    def is_open(self) -> bool:
        """Whether the index takes writes (a cheap check, made per batch)."""
        return self._is_open

    def refused(self, exc: BaseException, what: str) -> None:
        """A write (``what``, for the log) was refused for lack of memory: shut the gate,
        or keep it shut; warn at most once per interval."""
        self._errors.inc()
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
            ("index", "oom"),
            "index writes refused: Redis is out of memory (%s, on %s); dropping batches and "
            "retrying every %.0f s at most; raise Redis's maxmemory or free memory",
            exc,
            what,
            self._retry_max_s,
        )

    async def probe(self) -> bool:
        """While shut and a probe is due, read Redis's memory; open when it has room.

        Returns:
            Whether the gate is open now.

        Raises:
            redis.exceptions.RedisError: Redis failed (unreachable, say).
        """
        if self._is_open or time.monotonic() < self._probe_at:
            return self._is_open
        if not all(_has_room(info) for info in await self._memory()):
            self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)
            self._probe_at = time.monotonic() + self._backoff_s
            return False
        self._is_open = True
        self._opened_at = time.monotonic()
        self._metrics.writable.set(1)
        log.info("index writes accepted again: Redis has memory; rebuilding the workers "
                 "whose batches were dropped")  # fmt: skip
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
