"""Publisher lifetime ids of kvroute workers: what tells a restart from a seq gap.

A kvroute worker picks a random ``lifetime_id`` when its process starts and reports it in
``GET /health`` (and ``GET /v1/snapshot``). Its seqs restart at 0 with each lifetime, so a
restart whose first batches were lost shows as a seq *jump*, like a gap; comparing the id
the worker reports now with the one recorded when its entries were built tells the two
apart. vLLM engines report no id: for them a jump is always a gap (vLLM's protocol).
"""

from __future__ import annotations

import logging
from typing import Final

import aiohttp
import msgspec

from router.workers.registry import WorkerRecord

__all__ = ["LifetimeTracker"]

_HEALTH_PATH: Final = "/health"

log = logging.getLogger(__name__)


class _Health(msgspec.Struct):
    # NOTE: only the field read here; /health carries more (status, load figures).
    lifetime_id: str


class LifetimeTracker:
    """The publisher lifetime id recorded per kvroute worker, read from ``GET /health``.

    Only workers with ``has_snapshot`` (kvroute workers with an HTTP URL) are asked;
    for others every method is a no-op answering "unknown".

    Args:
        session: The HTTP session to use (owned by the caller).
        timeout_s: Timeout of one ``GET /health``; short, as a seq jump waits for it.
    """

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # NOTE: a worker's id is that of the lifetime whose batches the index holds, or
        # of an older one (the next jump then resets: safe), never a newer one. Absent:
        # unknown.
        self._recorded: dict[str, str] = {}

    def recorded(self, worker_id: str) -> str | None:
        """The id recorded for ``worker_id`` (``None``: unknown)."""
        return self._recorded.get(worker_id)

    async def record(self, record: WorkerRecord) -> None:
        """Record the id the worker reports now (read it *before* fetching a snapshot)."""
        current = await self._current(record)
        if current is None:
            self._recorded.pop(record.worker_id, None)
        else:
            self._recorded[record.worker_id] = current

    async def changed(self, record: WorkerRecord) -> bool:
        """Asked on a seq jump: does the worker report another lifetime than the recorded one?

        ``False`` when it reports the same, when it does not answer (logged) and when no
        id was recorded (the current one is recorded now): the jump is then a gap.
        """
        current = await self._current(record)
        if current is None:
            return False
        recorded = self._recorded.setdefault(record.worker_id, current)
        return current != recorded

    def adopt(self, worker_id: str, lifetime_id: str | None) -> None:
        """Take the id another router recorded (handed over with the worker's lease)."""
        if lifetime_id is None:
            self._recorded.pop(worker_id, None)
        else:
            self._recorded[worker_id] = lifetime_id

    def forget(self, worker_id: str) -> None:
        """Drop what was recorded for a worker no longer ingested."""
        self._recorded.pop(worker_id, None)

    async def _current(self, record: WorkerRecord) -> str | None:
        """The id the worker reports now, whatever its status (a draining worker: 503)."""
        if not record.has_snapshot or record.http_url is None:
            return None
        url = record.http_url.rstrip("/") + _HEALTH_PATH
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                body = await response.read()
            return msgspec.json.decode(body, type=_Health).lifetime_id
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning(
                "worker %s: GET %s gave no publisher lifetime id (%r); "
                "its seq jumps are taken for gaps until it does",
                record.worker_id,
                url,
                exc,
            )
            return None
