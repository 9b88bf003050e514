"""RegistryWatch: the registrations are read again only when the registry's version moved."""

from __future__ import annotations

import asyncio

from events.identity import WorkerId
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRecord, WorkerRegistry
from router.workers.registry_watch import RegistryWatch


def _record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id=WorkerId(worker_id), events_endpoint="tcp://127.0.0.1:9")


def test_registrations_are_read_only_after_a_change(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        client = await connect(redis_url)
        try:
            registry = WorkerRegistry(client, KeyLayout(namespace))
            other = WorkerRegistry(client, KeyLayout(namespace))  # another router's
            watch = RegistryWatch(registry, reread_s=3600.0)
            assert await watch.changed() == []  # the first call reads
            assert await watch.changed() is None
            await other.save(_record("a"))
            assert await watch.changed() == [_record("a")]
            assert await watch.changed() is None
            assert not await other.create(_record("a"))  # no change: no new version
            assert await watch.changed() is None
            assert await other.unregister(WorkerId("a"))
            assert await watch.changed() == []
            await client.delete(KeyLayout(namespace).registry_version)  # Redis forgot it all
            await other.register(_record("b"))
            assert await watch.changed() == [_record("b")]
        finally:
            await client.aclose()

    asyncio.run(scenario())
