"""Ingest: a kvroute worker's publisher lifetime id tells a restart from a seq gap.

Real publishers, ZeroMQ, HTTP and Redis. A seq *jump* is a gap (replayed, entries kept)
while the worker reports the lifetime id recorded for it; a new id means it restarted and
its new lifetime's first batches were lost (entries cleared, rebuilt); a worker that
gives no id is treated as today (vLLM's protocol: the jump is a gap).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

import pytest

from events.identity import WorkerId
from tests.support.ingest import (
    BY_HAND,
    FakeWorker,
    LifetimeWorker,
    Stack,
    divergent,
    fake_workers,
    keys,
    lookup_is,
    match,
    stack,
    stored,
    stream_count,
)
from tests.support.polling import eventually

LIFETIME_TIMEOUT_S = 0.5


async def started(s: Stack, *workers: FakeWorker) -> None:
    """Start the ingest with a short ``GET /health`` timeout."""
    config = dataclasses.replace(s.ingest.config, lifetime_timeout_s=LIFETIME_TIMEOUT_S)
    s.ingest.config = config
    await s.ingest.start([w.record() for w in workers])


async def seen_live(s: Stack, worker: FakeWorker, batches: float) -> None:
    """Publish empty batches until the subscriber delivered more than ``batches``."""
    wid = worker.worker_id

    async def more() -> bool:
        if stream_count(s, "batches", wid) > batches:
            return True
        worker.publish()
        return False

    await eventually(more, what=f"a batch from {wid} after {batches}")


@pytest.mark.slow
@pytest.mark.parametrize("health", ["ok", "none", "silent"])
def test_gap_is_replayed_and_entries_kept(
    redis_url: str, namespace: str, health: Literal["ok", "none", "silent"]
) -> None:
    """Same lifetime id, no ``/health`` (404) or one that never answers: a jump is a gap."""

    async def main() -> None:
        skip: set[int] = set()
        worker = (
            FakeWorker("k1", skip_live_seqs=skip)
            if health == "none"
            else LifetimeWorker("k1", health=health, skip_live_seqs=skip)
        )
        async with fake_workers(worker) as (k1,), stack(redis_url, namespace) as s:
            k1.publish(stored(1, 0, 4))
            await started(s, k1)
            await s.handshake(k1)
            # Counted from here: probes the handshake lost to the slow joiner may have
            # cost a replay already on a loaded machine.
            gaps, replays = stream_count(s, "gaps", "k1"), stream_count(s, "replays", "k1")
            skip.add(k1.publish(stored(2, 0, 3)) + 1)  # the next batch is lost live
            k1.publish(stored(3, 0, 2))
            k1.publish()  # reveals the gap
            await eventually(lookup_is(s.index, 3, {"k1": match(2)}), what="replayed")
            assert dict(await s.index.lookup(keys(1))) == {WorkerId("k1"): match(4)}
            assert dict(await s.index.lookup(keys(2))) == {WorkerId("k1"): match(3)}
            assert await divergent(s.index, k1) == 0
            assert stream_count(s, "gaps", "k1") == gaps + 1
            assert stream_count(s, "replays", "k1") == replays + 1
            assert stream_count(s, "resets", "k1") == 0
            assert s.count("resets", worker="k1") == 0
            assert s.count("snapshots", worker="k1", outcome="ok") == 1  # at start only

    asyncio.run(main())


def test_jump_under_a_new_lifetime_is_a_reset(redis_url: str, namespace: str) -> None:
    """The subscriber's jump: the old lifetime's entries go, the new one is replayed."""

    async def main() -> None:
        skip: set[int] = set()
        async with (
            fake_workers(LifetimeWorker("k1", skip_live_seqs=skip)) as (k1,),
            stack(redis_url, namespace, **BY_HAND) as s,
        ):
            await started(s, k1)
            await s.handshake(k1)
            k1.publish(stored(1, 0, 4))
            await eventually(lookup_is(s.index, 1, {"k1": match(4)}), what="old lifetime")
            old_next = k1.publisher.next_seq
            seen = stream_count(s, "batches", "k1")
            skip.update(range(old_next + 2))  # the new lifetime's first batches are lost
            k1.restart_publisher()
            k1.publish(stored(2, 0, 3))  # seq 0: lost live, kept for replay
            await seen_live(s, k1, seen)  # first seen: a seq above the old last one
            await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="new lifetime")
            assert dict(await s.index.lookup(keys(1))) == {}
            assert await divergent(s.index, k1) == 0
            assert stream_count(s, "resets", "k1") == 1
            assert s.count("resets", worker="k1") == 1
            assert stream_count(s, "gaps", "k1") == 1  # the new lifetime, replayed from 0
            assert stream_count(s, "resyncs", "k1") == 0

    asyncio.run(main())


def test_jump_past_a_snapshot_under_a_new_lifetime_is_a_reset(
    redis_url: str, namespace: str
) -> None:
    """The ingest's jump (past a snapshot, nothing seen live): cleared, snapshot reloaded."""

    async def main() -> None:
        skip: set[int] = {0}
        async with (
            fake_workers(LifetimeWorker("k1", skip_live_seqs=skip)) as (k1,),
            stack(redis_url, namespace, **BY_HAND) as s,
        ):
            k1.publish(stored(1, 0, 4))  # seq 0, never live: only the snapshot has it
            await started(s, k1)
            assert dict(await s.index.lookup(keys(1))) == {WorkerId("k1"): match(4)}
            skip.update(range(4))
            k1.restart_publisher()
            k1.publish(stored(2, 0, 3))  # seq 0 of the new lifetime, lost live
            await seen_live(s, k1, 0)  # seq >= 4, above the snapshot's next_seq (1)
            await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="new lifetime")
            assert dict(await s.index.lookup(keys(1))) == {}
            assert await divergent(s.index, k1) == 0
            assert s.count("resets", worker="k1") == 1
            assert s.count("snapshots", worker="k1", outcome="ok") == 2
            assert s.count("replays", worker="k1", outcome="ok") == 0
            assert stream_count(s, "resets", "k1") == 0  # the subscriber saw no jump

    asyncio.run(main())


def test_a_restart_while_the_lease_was_parked_is_reset_at_the_takeover(
    redis_url: str, namespace: str
) -> None:
    """The router stops (its lease parked with its state of the worker), the worker restarts
    and stays quiet: the next router takes the handoff but sees the new lifetime id at once,
    so the old lifetime's entries do not outlive the takeover."""

    async def main() -> None:
        async with fake_workers(LifetimeWorker("k1")) as (k1,):
            async with stack(redis_url, namespace, owner="a") as a:
                await started(a, k1)
                await a.handshake(k1)
                k1.publish(stored(1, 0, 4))
                await eventually(lookup_is(a.index, 1, {"k1": match(4)}), what="indexed")
            k1.restart_publisher()  # a new lifetime, an empty cache, no batch yet
            async with stack(redis_url, namespace, owner="b") as b:
                await started(b, k1)
                assert b.count("handoffs", worker="k1", outcome="resumed") == 1
                assert b.count("resets", worker="k1") == 1
                assert dict(await b.index.lookup(keys(1))) == {}
                assert await divergent(b.index, k1) == 0

    asyncio.run(main())
