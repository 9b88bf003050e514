"""Publisher lifetimes of workers: what tells a restart from a seq gap, or from nothing at all.

A kvroute worker picks a random ``lifetime_id`` when its process starts and reports it in
``GET /health`` (and ``GET /v1/snapshot``). A vLLM engine names no lifetime, but its
``GET /metrics`` carries ``process_start_time_seconds`` (Prometheus' process metrics),
which changes with every restart of the process: that value stands for its lifetime id.
Seqs restart at 0 with each lifetime, so a restart whose first batches were lost shows as
a seq *jump*, like a gap, or even as the next seq (the old lifetime ended where the lost
batches did); comparing the id the worker reports now with the one recorded when its
entries were built tells them apart. The ingest asks on every seq jump, on the first batch
after a reconnect, and periodically. A worker without an HTTP URL reports nothing: for it
a jump is a gap (vLLM's protocol).
"""

from __future__ import annotations

import logging
from typing import Final

import aiohttp
import msgspec

from events.identity import WorkerId
from events.rate_limited_log import RateLimitedLog
from router.workers.registry import WorkerRecord

__all__ = ["LifetimeTracker", "Reported", "process_start_time"]

_HEALTH_PATH: Final = "/health"
_METRICS_PATH: Final = "/metrics"
_START_TIME: Final = b"process_start_time_seconds"
_LOG_INTERVAL_S: Final = 60.0
"""A worker that gives no lifetime id is asked every maintenance pass; say so this often."""

log = logging.getLogger(__name__)


class _Health(msgspec.Struct):
    # NOTE: only the fields read here; /health carries more (status, load figures).
    lifetime_id: str
    next_seq: int | None = None


class Reported(msgspec.Struct, frozen=True):
    """What a worker reports of its publisher now.

    Attributes:
        lifetime_id: Its lifetime id (see the module docstring).
        next_seq: The seq its publisher assigns next (every batch below it was published
            or dropped); ``None`` where the worker does not say (a vLLM engine).
    """

    lifetime_id: str
    next_seq: int | None = None


def process_start_time(metrics_text: bytes) -> str | None:
    """The value of ``process_start_time_seconds`` in a Prometheus text exposition, as
    written there (``None``: absent)."""
    for line in metrics_text.splitlines():
        if not line.startswith(_START_TIME):
            continue  # (comments start with '#')
        rest = line[len(_START_TIME) :]
        if rest.startswith(b"{"):  # labelled: name{...} value
            rest = rest[rest.find(b"}") + 1 :]
        elif not rest[:1].isspace():
            continue  # another metric whose name starts the same
        fields = rest.split()
        if fields:
            return fields[0].decode("ascii", "replace")
    return None


class LifetimeTracker:
    """The publisher lifetime id recorded per worker.

    Workers with an HTTP URL are asked: kvroute workers through ``GET /health``, vLLM
    engines through ``GET /metrics``; for others every method is a no-op answering
    "unknown".

    Args:
        session: The HTTP session to use (owned by the caller).
        timeout_s: Timeout of one request; short, as a seq jump waits for it.
    """

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._warn = RateLimitedLog(_LOG_INTERVAL_S, log)
        # NOTE: a worker's id is that of the lifetime whose batches the index holds, or
        # of an older one (the next check then resets: safe), never a newer one. Absent:
        # unknown.
        self._recorded: dict[str, str] = {}

    @staticmethod
    def can_tell(record: WorkerRecord) -> bool:
        """Whether the worker can be asked for its lifetime (it has an HTTP URL)."""
        return record.http_url is not None

    def recorded(self, worker_id: WorkerId) -> str | None:
        """The id recorded for ``worker_id`` (``None``: unknown)."""
        return self._recorded.get(worker_id)

    async def changed(self, record: WorkerRecord) -> bool:
        """Asked on a seq jump: does the worker report another lifetime than the recorded one?

        ``False`` when it reports the same, when it does not answer (logged) and when no
        id was recorded (the current one is recorded now): the jump is then a gap.
        """
        current = await self.current(record)
        if current is None:
            return False
        recorded = self._recorded.setdefault(record.worker_id, current)
        return current != recorded

    def adopt(self, worker_id: WorkerId, lifetime_id: str | None) -> None:
        """Record ``lifetime_id`` (read already, or handed over with the worker's lease)."""
        if lifetime_id is None:
            self._recorded.pop(worker_id, None)
        else:
            self._recorded[worker_id] = lifetime_id

    def forget(self, worker_id: WorkerId) -> None:
        """Drop what was recorded for a worker no longer ingested."""
        self._recorded.pop(worker_id, None)

    async def current(self, record: WorkerRecord) -> str | None:
        """The id the worker reports now, whatever its status (a draining worker: 503);
        ``None`` when it cannot tell or does not answer (logged at a limited rate)."""
        reported = await self.report(record)
        return None if reported is None else reported.lifetime_id

    async def report(self, record: WorkerRecord) -> Reported | None:
        """What the worker reports of its publisher now: as :meth:`current`, with a
        kvroute worker's next seq (from the same ``GET /health``)."""
        if record.http_url is None:
            return None
        kvroute = record.kind == "kvroute"
        url = record.http_url.rstrip("/") + (_HEALTH_PATH if kvroute else _METRICS_PATH)
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                body = await response.read()
            if kvroute:
                health = msgspec.json.decode(body, type=_Health)
                return Reported(health.lifetime_id, health.next_seq)
            found = process_start_time(body)
            if found is None:
                raise ValueError("no process_start_time_seconds in it")
            return Reported(found)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
            self._warn.warning(
                (record.worker_id, "lifetime"),
                "worker %s: GET %s gave no publisher lifetime (%r); its restarts are "
                "seen only as seq drops until it does",
                record.worker_id,
                url,
                exc,
            )
            return None
