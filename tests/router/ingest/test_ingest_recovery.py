"""Ingest recovery: Redis restarted empty, replica takeover, stale writers, router restarts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from events.identity import WorkerId
from router.store.server import RedisServer
from tests.support.ingest import (
    FakeWorker,
    Stack,
    divergent,
    fake_workers,
    keys,
    lookup_is,
    match,
    stack,
    stored,
)
from tests.support.polling import eventually


def test_redis_restarted_empty_is_rebuilt(private_redis: RedisServer, namespace: str) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeWorker("k1"), FakeWorker("v1", kind="vllm")) as (k1, v1),
            stack(
                private_redis.url,
                namespace,
                [k1.record(), v1.record()],
                lease_ttl_ms=3_000,
                maintain_interval_s=0.1,
            ) as s,
        ):
            k1.publish(stored(1, 0, 4))
            v1.publish(stored(2, 0, 3))
            await s.handshake(k1, v1)
            await eventually(lookup_is(s.index, 1, {"k1": match(4)}), what="k1 before")
            await eventually(lookup_is(s.index, 2, {"v1": match(3)}), what="v1 before")

            private_redis.stop()
            private_redis.start()  # same port, no data: index, leases, registry all gone

            # The kvroute worker is rebuilt from its snapshot by maintenance, even idle.
            await eventually(lookup_is(s.index, 1, {"k1": match(4)}), what="k1 rebuilt")

            # The vLLM worker is rebuilt by replay at its next batch.
            async def v1_rebuilt() -> bool:
                if dict(await s.index.lookup(keys(2))) == {WorkerId("v1"): match(3)}:
                    return True
                v1.publish()
                return False

            await eventually(v1_rebuilt, what="v1 rebuilt")
            k1.publish(stored(1, 4, 1))
            await eventually(lookup_is(s.index, 1, {"k1": match(5)}), what="k1 live again")
            assert await divergent(s.index, k1) == 0
            assert [r.worker_id for r in await s.registry.records()] == ["k1", "v1"]
            assert s.count("leases_lost", worker="k1") >= 1

    asyncio.run(main())


def test_second_replica_takes_over_and_restarted_router_resumes(
    redis_url: str, namespace: str
) -> None:
    async def main() -> None:
        async with fake_workers(FakeWorker("k1")) as (k1,):
            k1.publish(stored(1, 0, 2))
            async with (
                stack(redis_url, namespace, [k1.record()], owner="a") as a,
                # Named so that k1's owner among {a, b} is a (router.workers.leases.owner_of).
                stack(redis_url, namespace, [], owner="e") as b,
            ):
                # b found the persisted registration but a holds the lease.
                assert a.ingest.owned_workers == [WorkerId("k1")]
                assert b.ingest.owned_workers == []
                await a.handshake(k1)
                await a.ingest.close()  # a stops: its leases are released
                await eventually(owns(b, "k1"), what="b takes over")
                await b.handshake(k1)
                k1.publish(stored(1, 2, 2))
                await eventually(lookup_is(b.index, 1, {"k1": match(4)}), what="b writes")
                assert await divergent(b.index, k1) == 0
            # Both routers are gone; a new one resumes from the registration in Redis.
            async with stack(redis_url, namespace, [], owner="c") as c:
                assert c.ingest.owned_workers == [WorkerId("k1")]
                assert await divergent(c.index, k1) == 0

    asyncio.run(main())


@pytest.mark.slow
def test_stale_router_cannot_write_after_its_lease_lapsed(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeWorker("k1")) as (k1,),
            # a never renews (a stalled process): its lease lapses after 500 ms.
            stack(
                redis_url,
                namespace,
                [k1.record()],
                owner="a",
                lease_ttl_ms=500,
                maintain_interval_s=3600,
            ) as a,
        ):
            await a.handshake(k1)
            async with stack(redis_url, namespace, [], owner="b") as b:
                await eventually(owns(b, "k1"), what="b takes the lapsed lease")
                k1.publish(stored(1, 0, 3))
                await eventually(lookup_is(b.index, 1, {"k1": match(3)}), what="b writes")

                async def a_refused() -> bool:
                    return a.count("leases_lost", worker="k1") >= 1

                await eventually(a_refused, what="a's write is fenced")
                assert await divergent(b.index, k1) == 0

    asyncio.run(main())


@pytest.mark.parametrize("head_start", [0, 1, 2, 4, 8])
def test_removal_racing_maintenance_stays_removed_and_can_be_revived(
    redis_url: str, namespace: str, head_start: int
) -> None:
    async def main() -> None:
        wid = WorkerId("k1")
        async with (
            fake_workers(FakeWorker("k1")) as (k1,),
            stack(redis_url, namespace, [k1.record()], maintain_interval_s=3600) as s,
        ):
            await s.handshake(k1)
            k1.publish(stored(1, 0, 3))
            await eventually(lookup_is(s.index, 1, {"k1": match(3)}), what="indexed")

            async def maintain() -> None:
                for _ in range(head_start):  # the removal gets this many steps ahead
                    await asyncio.sleep(0)
                await s.ingest.maintain_once()

            await asyncio.gather(s.ingest.remove_worker(wid), maintain())
            await s.ingest.maintain_once()
            assert await s.registry.records() == []
            assert s.ingest.owned_workers == []
            assert dict(await s.index.lookup(keys(1))) == {}
            # Revived (twice: the second call changes nothing), then ingested again.
            await s.ingest.add_worker(k1.record())
            await s.ingest.add_worker(k1.record())
            assert await s.registry.records() == [k1.record()]
            assert s.ingest.owned_workers == [wid]
            await eventually(lookup_is(s.index, 1, {"k1": match(3)}), what="snapshot reloaded")
            await s.handshake(k1)
            k1.publish(stored(2, 0, 2))
            await eventually(lookup_is(s.index, 2, {"k1": match(2)}), what="live again")

    asyncio.run(main())


def owns(s: Stack, worker_id: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return WorkerId(worker_id) in s.ingest.owned_workers

    return check


def test_a_worker_stream_outlives_an_unexpected_error_while_applying(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while applying a batch (injected here) fails that batch alone: it is counted
    and logged, the worker is rebuilt at its next batch, and its stream goes on (it once
    ended the worker's event reader, and the worker's index entries froze)."""

    async def main() -> None:
        async with (
            fake_workers(FakeWorker("v1", kind="vllm")) as (v1,),
            stack(redis_url, namespace, [v1.record()]) as s,
        ):
            await s.handshake(v1)
            v1.publish(stored(1, 0, 2))
            await eventually(lookup_is(s.index, 1, {"v1": match(2)}), what="before")
            worker_ingest = type(s.ingest._workers[WorkerId("v1")])
            apply_batch = worker_ingest.apply_batch

            async def fail_once(self: object, received: object) -> None:
                monkeypatch.setattr(worker_ingest, "apply_batch", apply_batch)
                raise RuntimeError("injected bug")

            monkeypatch.setattr(worker_ingest, "apply_batch", fail_once)
            v1.publish(stored(1, 2, 1))  # lost to the bug: the rebuild replays it
            await eventually(
                lambda: _counted(s, "v1", "failed"), what="the failed batch is counted"
            )
            v1.publish(stored(1, 3, 1))
            await eventually(lookup_is(s.index, 1, {"v1": match(4)}), what="rebuilt, alive")

    asyncio.run(main())


async def _counted(s: Stack, worker: str, outcome: str) -> bool:
    return s.count("batches", worker=worker, outcome=outcome) == 1
