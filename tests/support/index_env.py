"""A prefix index under test, whichever kind, and how to clean up a test's namespace."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from events.identity import WorkerId
from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.store.connection import RedisClient
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry


@dataclass
class IndexEnv:
    """An index under test and how to make it writable for a worker."""

    index: MemoryPrefixIndex | RedisPrefixIndex
    registry: WorkerRegistry | None = None

    async def prepare(self, worker_id: str) -> None:
        """Take the worker's lease (Redis) so the index accepts its writes."""
        if self.registry is None or not isinstance(self.index, RedisPrefixIndex):
            return
        lease = await self.registry.acquire(WorkerId(worker_id))
        assert lease is not None
        self.index.use_lease(WorkerId(worker_id), lease.token)

    async def settle(self) -> None:
        """Wait for queued writes (group commit) so reads see every applied batch."""
        if isinstance(self.index, RedisPrefixIndex):
            await self.index.flush()


OpenIndex = Callable[[], AbstractAsyncContextManager[IndexEnv]]
"""What the ``open_index`` fixtures give: ``async with open_index() as env``."""


async def drop_namespace(client: RedisClient, layout: KeyLayout) -> None:
    """Delete every key of a test namespace (tests never flush a shared server)."""
    async for key in client.scan_iter(match=layout.prefix + "*", count=1000):
        await client.delete(key)
