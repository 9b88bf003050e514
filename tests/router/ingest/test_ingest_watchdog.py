"""Ingest: a stream quiet for longer than the idle bound has its position checked.

Real publishers, ZeroMQ, HTTP and Redis. A batch published into a connection that lost
it (here: never sent live, kept for replay, as a connection that died half-open leaves
it) and followed by silence is caught up by the idle check alone, for a kvroute worker
(its ``GET /health`` next seq says it is behind) and for a vLLM-style publisher (a
replay from the last seq seen brings it); a quiet stream that missed nothing is left
alone; a worker with no replay endpoint is resynced from its snapshot.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest

from tests.support.ingest import (
    FakeWorker,
    LifetimeWorker,
    Stack,
    divergent,
    fake_workers,
    lookup_is,
    match,
    stack,
    stored,
    stream_count,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

IDLE_S = 0.5
"""The idle bound of these tests (30 s by default)."""


def make_worker(kind: Literal["kvroute", "vllm"], skip: set[int], **kwargs: Any) -> FakeWorker:
    """A kvroute worker reporting its next seq in ``GET /health``, or a vLLM-style
    publisher (no HTTP: only its replay endpoint can tell)."""
    if kind == "kvroute":
        return LifetimeWorker("w1", skip_live_seqs=skip, **kwargs)
    return FakeWorker("w1", kind="vllm", skip_live_seqs=skip, **kwargs)


async def started_with_a_batch(s: Stack, w1: FakeWorker) -> None:
    """Start the ingest of ``w1`` and see one of its batches reach the index live."""
    await s.ingest.start([w1.record()])
    await s.handshake(w1)
    w1.publish(stored(1, 0, 4))
    await eventually(lookup_is(s.index, 1, {"w1": match(4)}), what="a live batch")


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_batch_lost_live_is_caught_up_when_the_stream_goes_quiet(
    redis_url: str, namespace: str, kind: Literal["kvroute", "vllm"]
) -> None:
    async def main() -> None:
        skip: set[int] = set()
        async with (
            fake_workers(make_worker(kind, skip)) as (w1,),
            stack(redis_url, namespace, idle_check_s=IDLE_S) as s,
        ):
            await started_with_a_batch(s, w1)
            # Counted from here: on a loaded machine a check may have replayed probes the
            # handshake lost to the slow joiner.
            replayed = s.count("idle_checks", worker="w1", outcome="replayed")
            resubscribed, gaps = (stream_count(s, n, "w1") for n in ("resubscribes", "gaps"))
            skip.add(w1.publisher.next_seq)
            w1.publish(stored(2, 0, 3))  # lost live; nothing follows it
            await eventually(lookup_is(s.index, 2, {"w1": match(3)}), what="the idle check")
            assert s.count("idle_checks", worker="w1", outcome="replayed") == replayed + 1
            assert stream_count(s, "resubscribes", "w1") == resubscribed + 1
            assert stream_count(s, "gaps", "w1") == gaps  # no later batch showed the loss
            if kind == "kvroute":
                assert await divergent(s.index, w1) == 0
            # The connection made again carries the next batch live.
            w1.publish(stored(3, 0, 2))
            await eventually(lookup_is(s.index, 3, {"w1": match(2)}), what="live again")
            assert s.count("idle_checks", worker="w1", outcome="replayed") == replayed + 1

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
def test_a_quiet_stream_that_missed_nothing_is_left_alone(
    redis_url: str, namespace: str, kind: Literal["kvroute", "vllm"]
) -> None:
    async def main() -> None:
        async with (
            fake_workers(make_worker(kind, set())) as (w1,),
            stack(redis_url, namespace, idle_check_s=IDLE_S) as s,
        ):
            await started_with_a_batch(s, w1)
            checked = s.count("idle_checks", worker="w1", outcome="current")
            before = s.total("idle_checks", worker="w1")
            resubscribed = stream_count(s, "resubscribes", "w1")
            resyncs = s.total("resyncs", worker="w1")  # the first lease's load, say

            async def checked_twice() -> bool:
                return s.count("idle_checks", worker="w1", outcome="current") >= checked + 2

            await eventually(checked_twice, what="two idle checks")
            # Every check since the batch found the stream current.
            done = s.total("idle_checks", worker="w1") - before
            assert s.count("idle_checks", worker="w1", outcome="current") - checked == done
            assert stream_count(s, "resubscribes", "w1") == resubscribed
            assert s.total("resyncs", worker="w1") == resyncs
            assert await lookup_is(s.index, 1, {"w1": match(4)})()

    asyncio.run(main())


def test_a_kvroute_worker_without_replay_is_resynced_from_its_snapshot(
    redis_url: str, namespace: str
) -> None:
    async def main() -> None:
        skip: set[int] = set()
        async with (
            fake_workers(make_worker("kvroute", skip, replay=False)) as (w1,),
            stack(redis_url, namespace, idle_check_s=IDLE_S) as s,
        ):
            await s.ingest.start([w1.record()])
            await s.handshake(w1)
            resubscribed = stream_count(s, "resubscribes", "w1")
            skip.add(w1.publisher.next_seq)
            w1.publish(stored(1, 0, 4))  # lost live, and no replay to bring it
            await eventually(lookup_is(s.index, 1, {"w1": match(4)}), what="the resync")
            assert s.count("idle_checks", worker="w1", outcome="resynced") == 1
            assert s.count("resyncs", worker="w1", reason="idle_behind") == 1
            assert stream_count(s, "resubscribes", "w1") == resubscribed + 1
            assert await divergent(s.index, w1) == 0

    asyncio.run(main())


def test_a_vllm_stream_never_heard_live_is_rebuilt_by_the_check(
    redis_url: str, namespace: str
) -> None:
    """Nothing of it came live since its lease was taken, so the first batch the check
    delivers asks for the rebuild (a replay from seq 0) from inside that delivery."""

    async def main() -> None:
        skip = set(range(100))  # nothing is sent live
        async with (
            fake_workers(make_worker("vllm", skip)) as (w1,),
            stack(redis_url, namespace, idle_check_s=IDLE_S) as s,
        ):
            await s.ingest.start([w1.record()])
            w1.publish(stored(1, 0, 4))
            w1.publish(stored(2, 0, 3))
            await eventually(lookup_is(s.index, 2, {"w1": match(3)}), what="the idle check")
            assert await lookup_is(s.index, 1, {"w1": match(4)})()
            assert s.count("idle_checks", worker="w1", outcome="replayed") >= 1
            assert s.total("resyncs", worker="w1") == 0
            assert stream_count(s, "batches", "w1") >= 2

    asyncio.run(main())
