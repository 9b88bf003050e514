"""Router replicas share the ingest: each worker is ingested by its owner among the live
routers (rendezvous hashing); a joining replica gets its share handed over, a leaving
one's workers are taken back, and the index stays exact throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from events.identity import WorkerId
from router.workers.leases import owner_of
from tests.support.ingest import (
    FakeWorker,
    Stack,
    divergent,
    fake_workers,
    stack,
    stored,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

IDS = [f"k{i}" for i in range(6)]


def owned_by(s: Stack, expected: set[str]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return set(s.ingest.owned_workers) == {WorkerId(w) for w in expected}

    return check


def test_replicas_split_workers_and_take_them_back(redis_url: str, namespace: str) -> None:
    share_b = {w for w in IDS if owner_of(w, ["a", "b"]) == "b"}
    assert share_b and share_b != set(IDS)  # both replicas own some with these names

    async def main() -> None:
        async with fake_workers(*(FakeWorker(w) for w in IDS)) as workers:
            for n, worker in enumerate(workers):
                worker.publish(stored(n + 1, 0, 3))
            async with stack(redis_url, namespace, [w.record() for w in workers], owner="a") as a:
                assert set(a.ingest.owned_workers) == set(IDS)  # alone, a owns every worker
                await a.handshake(*workers)
                async with stack(redis_url, namespace, [], owner="b") as b:
                    await eventually(owned_by(b, share_b), what="b gets its share")
                    await eventually(owned_by(a, set(IDS) - share_b), what="a hands it over")
                    mine = [w for w in workers if w.worker_id in share_b]
                    await b.handshake(*mine)
                    for n, worker in enumerate(workers):
                        worker.publish(stored(n + 1, 3, 2))  # both replicas keep ingesting
                    await eventually(
                        lambda: _exact(a, *workers), what="index exact with two replicas"
                    )
                    assert sum(a.count("handovers", worker=w) for w in share_b) == len(share_b)
                # b left: a takes its workers back at once (no lease TTL to wait out).
                await eventually(owned_by(a, set(IDS)), what="a takes b's workers back")
                await eventually(lambda: _exact(a, *workers), what="index exact again")

    asyncio.run(main())


async def _exact(s: Stack, *workers: FakeWorker) -> bool:
    return await divergent(s.index, *workers) == 0
