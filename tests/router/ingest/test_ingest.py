"""Ingest end to end: real publishers, real ZeroMQ, real HTTP snapshots, real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from events.identity import WorkerId
from tests.support.ingest import (
    FakeWorker,
    divergent,
    fake_workers,
    keys,
    lookup_is,
    match,
    removed,
    stack,
    stored,
)
from tests.support.polling import eventually


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.slow)])
def any_redis(request: pytest.FixtureRequest) -> str:
    """A single Redis node or the three-master cluster."""
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(fixture))


def test_snapshot_then_live_events(any_redis: str, namespace: str) -> None:
    async def main() -> None:
        async with fake_workers(FakeWorker("k1"), FakeWorker("k2")) as (k1, k2):
            k1.publish(stored(1, 0, 4))
            k1.publish(stored(2, 0, 3))
            k2.publish(stored(1, 0, 2))
            async with stack(any_redis, namespace, [k1.record(), k2.record()]) as s:
                # start() loaded both snapshots before returning.
                assert dict(await s.index.lookup(keys(1))) == {
                    WorkerId("k1"): match(4),
                    WorkerId("k2"): match(2),
                }
                assert s.count("snapshots", worker="k1", outcome="ok") == 1
                await s.handshake(k1, k2)
                k1.publish(stored(1, 4, 2))
                k1.publish(removed(2, 2))
                k2.publish(stored(2, 0, 1), stored(2, 0, 1))  # two copies of one block
                k2.publish(removed(2, 0))
                await eventually(
                    lookup_is(s.index, 1, {"k1": match(6), "k2": match(2)}), what="k1 grows"
                )
                await eventually(
                    lookup_is(s.index, 2, {"k1": match(2), "k2": match(1)}), what="prompt 2"
                )
                assert await divergent(s.index, k1, k2) == 0
                assert s.ingest.owned_workers == [WorkerId("k1"), WorkerId("k2")]

    asyncio.run(main())


def test_gap_is_replayed(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        skip: set[int] = set()
        async with (
            fake_workers(FakeWorker("k1", skip_live_seqs=skip)) as (k1,),
            stack(redis_url, namespace, [k1.record()]) as s,
        ):
            await s.handshake(k1)
            first = k1.publisher.next_seq
            skip.update({first + 1, first + 2})  # never sent live: only replay can deliver them
            k1.publish(stored(1, 0, 2))
            k1.publish(stored(1, 2, 2))
            k1.publish(stored(1, 4, 2))
            k1.publish(stored(1, 6, 1))
            await eventually(lookup_is(s.index, 1, {"k1": match(7)}), what="gap replayed")
            assert await divergent(s.index, k1) == 0
            assert s.count("orphan_parents", worker="k1") == 0
            # The subscriber's stream counters are exported beside the ingest's.
            sample = s.metrics.registry.get_sample_value
            assert sample("kvroute_stream_gaps_total", {"worker": "k1"}) == 1
            assert sample("kvroute_stream_missed_batches_total", {"worker": "k1"}) == 2
            # Each batch applied once, its events counted by type.
            k1.publish(stored(2, 0, 1), stored(3, 0, 1), removed(2, 0))

            async def counted() -> bool:
                return s.count("events", worker="k1", type="BlockRemoved") == 1

            await eventually(counted, what="the mixed batch applied")
            assert s.count("events", worker="k1", type="BlockStored") == 4 + 2

    asyncio.run(main())


def test_late_join_of_a_vllm_worker_replays_its_history(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        async with fake_workers(FakeWorker("v1", kind="vllm")) as (v1,):
            v1.publish(stored(1, 0, 3))
            v1.publish(stored(1, 3, 2))
            async with stack(redis_url, namespace, [v1.record()]) as s:
                await s.handshake(v1)
                v1.publish(stored(1, 5, 1))
                await eventually(lookup_is(s.index, 1, {"v1": match(6)}), what="history")
                assert s.count("replays", worker="v1", outcome="ok") >= 1
                assert s.count("orphan_parents", worker="v1") == 0

    asyncio.run(main())


def test_orphan_parent_is_replayed_from_seq_zero(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        async with fake_workers(FakeWorker("k1")) as (k1,):
            k1.publish(stored(1, 0, 3))
            k1.hide_snapshot = True  # a snapshot that lacks the chain: the parent is unknown
            async with stack(redis_url, namespace, [k1.record()]) as s:
                assert dict(await s.index.lookup(keys(1))) == {}
                await s.handshake(k1)
                k1.hide_snapshot = False
                k1.publish(stored(1, 3, 2))
                await eventually(lookup_is(s.index, 1, {"k1": match(5)}), what="replayed")
                assert s.count("orphan_parents", worker="k1") == 1
                assert s.count("replays", worker="k1", outcome="ok") >= 1  # (+ slow joiner)
                assert s.count("resyncs", worker="k1", reason="orphan_parent") == 0
                assert await divergent(s.index, k1) == 0

    asyncio.run(main())


def test_orphan_that_replay_cannot_fix_resyncs(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeWorker("v1", kind="vllm")) as (v1,),
            stack(redis_url, namespace, [v1.record()]) as s,
        ):
            await s.handshake(v1)
            v1.publish(stored(1, 0, 2))
            await eventually(lookup_is(s.index, 1, {"v1": match(2)}), what="first chain")
            v1.publish(stored(1, 2, 1, bad_tokens=True))  # malformed: skipped, counted
            v1.publish(stored(1, 3, 2))  # its parent never reached the index
            v1.publish(stored(3, 0, 1))
            await eventually(lookup_is(s.index, 3, {"v1": match(1)}), what="after resync")
            # Replay re-delivers the malformed event, so only a resync helps; the
            # vLLM worker has no snapshot: the index keeps what it saw (never more).
            assert dict(await s.index.lookup(keys(1))) == {}
            assert s.count("orphan_parents", worker="v1") >= 1
            assert s.count("resyncs", worker="v1", reason="orphan_parent") == 1
            assert s.count("skipped", worker="v1", reason="malformed") >= 1
            assert s.count("skipped", worker="v1", reason="detached") >= 1
            v1.publish(stored(1, 0, 3))  # recached from scratch: indexed again
            await eventually(lookup_is(s.index, 1, {"v1": match(3)}), what="recached")

    asyncio.run(main())


def test_publisher_restart_clears_the_worker(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeWorker("k1")) as (k1,),
            stack(redis_url, namespace, [k1.record()]) as s,
        ):
            await s.handshake(k1)
            k1.publish(stored(1, 0, 4))
            for _ in range(300):  # room for the new lifetime's seqs to stay below
                k1.publish()
            await eventually(lookup_is(s.index, 1, {"k1": match(4)}), what="before")

            async def delivered() -> bool:
                return s.count("batches", worker="k1", outcome="applied") >= 302

            await eventually(delivered, what="all delivered")
            k1.restart_publisher()

            last_probe = [0.0]

            async def reset_seen() -> bool:
                # Probe with empty batches, at most 10/s: the new lifetime's seqs stay
                # below the old ones (302) for 30 s of reconnecting, so the router can
                # tell a restart from a gap (vLLM's protocol cannot otherwise).
                if s.count("resets", worker="k1") >= 1:
                    return True
                if time.monotonic() - last_probe[0] >= 0.1:
                    last_probe[0] = time.monotonic()
                    k1.publish()
                return False

            await eventually(reset_seen, what="the new publisher lifetime is seen")
            k1.publish(stored(2, 0, 1))
            await eventually(lookup_is(s.index, 2, {"k1": match(1)}), what="new lifetime")
            assert dict(await s.index.lookup(keys(1))) == {}
            assert await divergent(s.index, k1) == 0

    asyncio.run(main())
