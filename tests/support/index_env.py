"""A prefix index under test, whichever store, and how to clean up a test's namespace."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from events.hashing import BlockKey
from events.identity import WorkerId
from router.index.base import PrefixMatch
from router.index.group_commit import GroupCommitIndex
from router.ingest.bridged_index import BridgedIndex
from router.store.connection import RedisClient
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry


@dataclass
class IndexEnv:
    """An index under test (a store behind the workers' bridges) and the registry whose
    leases fence its writes (None: a store in one process, nothing to fence)."""

    index: BridgedIndex
    registry: WorkerRegistry | None = None

    async def prepare(self, worker_id: str) -> None:
        """Take the worker's lease, if the store is fenced, so it accepts the worker's writes."""
        if self.registry is None:
            return
        lease = await self.registry.acquire(WorkerId(worker_id))
        assert lease is not None
        self.index.use_lease(WorkerId(worker_id), lease.token)

    async def settle(self) -> None:
        """Wait for queued writes (group commit) so reads see every applied batch."""
        await self.index.flush()


class SettledGroupCommit(GroupCommitIndex):
    """Group commit whose lookups wait for every queued write first, so the contract
    tests, which look up right after a batch, run over it unchanged (the ingest's lookups
    do not wait: :meth:`GroupCommitIndex.lookup`)."""

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """The store's longest held prefix per candidate once every queued write landed."""
        await self.flush()
        return await super().lookup(keys, workers)


OpenIndex = Callable[[], AbstractAsyncContextManager[IndexEnv]]
"""What the ``open_index`` fixtures give: ``async with open_index() as env``."""


async def drop_namespace(client: RedisClient, layout: KeyLayout) -> None:
    """Delete every key of a test namespace (tests never flush a shared server)."""
    async for key in client.scan_iter(match=layout.prefix + "*", count=1000):
        await client.delete(key)
