"""RegistryWatch: the saved registrations, read again only when they changed.

A router follows the registrations other replicas save. Reading them all (one
``HGETALL`` and a decode per worker) every maintenance pass costs a 1,000-worker
router more than everything else it does at rest; the registry's version key
(:meth:`router.workers.registry.WorkerRegistry.version`) says in one ``GET`` whether
anything changed. A change made without it (a hand edit in Redis) is still seen within
``reread_s``.
"""

from __future__ import annotations

import time

from router.workers.registry import WorkerRecord, WorkerRegistry

__all__ = ["RegistryWatch"]


class RegistryWatch:
    """One reader's view of the registry's version.

    Args:
        registry: The registry to watch.
        reread_s: Longest time between two full reads, changed or not.
    """

    def __init__(self, registry: WorkerRegistry, reread_s: float = 30.0) -> None:
        self.registry = registry
        self.reread_s = reread_s
        # NOTE: the version as of the last full read, and when the next one is due
        # whatever the version (-inf: never read, so the first call reads).
        self._version: bytes | None = None
        self._next_read_at = float("-inf")

    async def changed(self) -> list[WorkerRecord] | None:
        """Every registration (as :meth:`WorkerRegistry.records`) when they may have
        changed since the last call; ``None`` when they did not.

        Raises:
            redis.exceptions.RedisError: Redis failed (the next call reads again).
        """
        version = await self.registry.version()
        now = time.monotonic()
        if version == self._version and now < self._next_read_at:
            return None
        records = await self.registry.records()
        self._version, self._next_read_at = version, now + self.reread_s
        return records
