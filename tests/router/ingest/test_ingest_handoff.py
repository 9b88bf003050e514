"""A lease given up on purpose carries the router's state of the worker: the next holder
continues the stream and the worker's entries stay, where a rebuild would lose them.

The vLLM-style workers here keep only 2 batches for replay (a real engine's ring reaches
back only so far), so a rebuild from seq 0 cannot restore blocks stored before the
handover: their continuation would be orphaned. Only a handed-over bridge keeps them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import router.ingest.worker_recovery as worker_recovery
from events.identity import WorkerId
from router.store.connection import connect
from router.store.layout import KeyLayout
from router.store.server import RedisServer
from router.workers.leases import owner_of
from router.workers.registry import WorkerRegistry
from tests.support.ingest import (
    FakeWorker,
    Stack,
    divergent,
    fake_workers,
    lookup_is,
    match,
    stack,
    stored,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

IDS = [f"v{i}" for i in range(6)]


def vllm_workers() -> list[FakeWorker]:
    return [FakeWorker(w, kind="vllm", buffer_steps=2) for w in IDS]


def owned_by(s: Stack, expected: set[str]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return set(s.ingest.owned_workers) == {WorkerId(w) for w in expected}

    return check


async def cache_first_blocks(s: Stack, workers: tuple[FakeWorker, ...]) -> None:
    """Each worker caches 3 blocks of its prompt, then enough empty batches that its replay
    ring no longer reaches them; waits until the index holds them."""
    await s.handshake(*workers)
    for n, worker in enumerate(workers):
        worker.publish(stored(n + 1, 0, 3))
        for _ in range(3):
            worker.publish()
    for n, worker in enumerate(workers):
        await eventually(
            lookup_is(s.index, n + 1, {worker.worker_id: match(3)}), what="first blocks"
        )


async def extend_and_check(s: Stack, workers: tuple[FakeWorker, ...]) -> None:
    """Each worker caches blocks 3-4, children of the blocks cached before; the index must
    hold all five (an orphaned continuation would leave the worker with none)."""
    for n, worker in enumerate(workers):
        worker.publish(stored(n + 1, 3, 2))
    for n, worker in enumerate(workers):
        await eventually(
            lookup_is(s.index, n + 1, {worker.worker_id: match(5)}), what="continuation"
        )


def test_a_joining_replica_continues_the_workers_it_is_handed(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    share_b = {w for w in IDS if owner_of(w, ["a", "b"]) == "b"}
    assert share_b and share_b != set(IDS)
    # Encoding and decoding a handoff run in threads: the event loop never waits on them.
    on_loop_thread: list[bool] = []

    def spy(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            on_loop_thread.append(threading.current_thread() is threading.main_thread())
            return fn(*args)

        return call

    for name in ("encode_handoff", "decode_handoff"):
        monkeypatch.setattr(worker_recovery, name, spy(getattr(worker_recovery, name)))

    async def main() -> None:
        async with (
            fake_workers(*vllm_workers()) as workers,
            stack(redis_url, namespace, [w.record() for w in workers], owner="a") as a,
        ):
            await cache_first_blocks(a, workers)
            async with stack(redis_url, namespace, [], owner="b") as b:
                await eventually(owned_by(b, share_b), what="b gets its share")
                await eventually(owned_by(a, set(IDS) - share_b), what="a hands it over")
                await b.handshake(*(w for w in workers if w.worker_id in share_b))
                await extend_and_check(a, workers)
                for w in share_b:
                    assert a.count("handoffs", worker=w, outcome="sent") == 1
                    assert b.count("handoffs", worker=w, outcome="resumed") == 1
                    assert b.total("resyncs", worker=w) == 0
                    assert b.total("orphan_parents", worker=w) == 0

    asyncio.run(main())
    assert len(on_loop_thread) >= 2 * len(share_b) and not any(on_loop_thread)


BY_HAND = {"maintain_interval_s": 3600.0, "lease_ttl_ms": 600_000}
"""Stack settings under which a test runs the maintenance passes itself."""


async def hand_over(a: Stack, b: Stack, workers: tuple[FakeWorker, ...]) -> set[str]:
    """Replica b joined (both replicas' passes run by hand): once b's streams are up, a
    hands b's share over; b has not taken it yet. Returns b's share."""
    mine = [w for w in workers if owner_of(w.worker_id, ["a", "b"]) == "b"]
    assert mine and len(mine) < len(workers)
    for worker in mine:  # b receives (and drops) their batches: its streams are up

        async def received(worker: FakeWorker = worker) -> bool:
            if b.count("batches", worker=worker.worker_id, outcome="not_owner"):
                return True
            worker.publish()
            return False

        await eventually(received, what=f"b receives {worker.worker_id}")
    await a.ingest.maintain_once()  # a sees b and hands its share over
    assert b.ingest.owned_workers == []
    return {w.worker_id for w in mine}


async def take_over(b: Stack, share: set[str]) -> None:
    """b's maintenance pass takes its share (with a's state of each worker)."""
    await b.ingest.maintain_once()
    assert set(b.ingest.owned_workers) == share
    for wid in share:
        assert b.count("handoffs", worker=wid, outcome="resumed") == 1


def test_batches_between_the_handoff_and_the_takeover_are_kept(
    redis_url: str, namespace: str
) -> None:
    """Without a replay endpoint (vLLM's default) a batch neither replica applied would be
    lost for good (a resync); the joining replica keeps what it receives meanwhile."""

    async def main() -> None:
        no_replay = [FakeWorker(w, kind="vllm", replay=False) for w in IDS]
        async with (
            fake_workers(*no_replay) as workers,
            stack(redis_url, namespace, [w.record() for w in workers], owner="a", **BY_HAND) as a,
        ):
            await cache_first_blocks(a, workers)
            async with stack(redis_url, namespace, [], owner="b", **BY_HAND) as b:
                share = await hand_over(a, b, workers)
                for n, worker in enumerate(workers):
                    worker.publish(stored(n + 1, 3, 1))  # no replica applies b's share now
                await eventually(
                    lambda: _kept(b, share), what="b received the batches it must keep"
                )
                await take_over(b, share)
                for n, worker in enumerate(workers):  # in the index at once, idle or not
                    await eventually(
                        lookup_is(a.index, n + 1, {worker.worker_id: match(4)}), what="kept"
                    )
                for n, worker in enumerate(workers):
                    worker.publish(stored(n + 1, 4, 1))
                for n, worker in enumerate(workers):
                    await eventually(
                        lookup_is(a.index, n + 1, {worker.worker_id: match(5)}), what="exact"
                    )
                for wid in share:
                    assert b.total("resyncs", worker=wid) == 0

    asyncio.run(main())


def test_a_replay_asked_for_by_a_kept_batch_applies_every_batch_once(
    redis_url: str, namespace: str
) -> None:
    """b missed a batch before it began keeping: its first kept batch follows a gap, so
    the next delivered batch asks for a replay, which redelivers the kept batches behind
    it too. Each goes in once, and the worker's stream goes on (it once died there: the
    redelivered batches drained the kept ones under the drain that asked for them)."""

    async def main() -> None:
        async with (
            fake_workers(*(FakeWorker(w, kind="vllm") for w in IDS)) as workers,
            stack(redis_url, namespace, [w.record() for w in workers], owner="a", **BY_HAND) as a,
        ):
            await cache_first_blocks(a, workers)
            async with stack(redis_url, namespace, [], owner="b", **BY_HAND) as b:
                share = await hand_over(a, b, workers)
                mine = [(n, w) for n, w in enumerate(workers) if w.worker_id in share]
                ingests = [b.ingest._workers[WorkerId(w.worker_id)] for _, w in mine]
                for ingest in ingests:  # as if b's first pass came after the handoff
                    ingest.keep_batches(False)
                await _publish_unowned(b, mine, 3)
                for ingest in ingests:  # only now: block 3's batch is missing from the kept
                    ingest.keep_batches(True)
                await _publish_unowned(b, mine, 4, 5)
                await take_over(b, share)  # the kept batches wait for the batch path
                for n, worker in mine:
                    worker.publish(stored(n + 1, 6, 1))  # asks for the replay
                for n, worker in mine:
                    await eventually(
                        lookup_is(a.index, n + 1, {worker.worker_id: match(7)}), what="replayed"
                    )
                    worker.publish(stored(n + 1, 7, 1))  # the stream goes on
                for n, worker in mine:
                    await eventually(
                        lookup_is(a.index, n + 1, {worker.worker_id: match(8)}), what="alive"
                    )
                    assert b.count("batches", worker=worker.worker_id, outcome="failed") == 0
                    assert b.total("resyncs", worker=worker.worker_id) == 0

    asyncio.run(main())


async def _publish_unowned(b: Stack, mine: list[tuple[int, FakeWorker]], *blocks: int) -> None:
    """Each worker of ``mine`` (``n``, worker) caches ``blocks`` of prompt ``n + 1``, one
    batch each; waits until b, which does not hold their leases, received them all."""
    for n, worker in mine:
        wid = worker.worker_id
        before = b.count("batches", worker=wid, outcome="not_owner")
        for block in blocks:
            worker.publish(stored(n + 1, block, 1))

        async def received(wid: str = wid, before: float = before) -> bool:
            return b.count("batches", worker=wid, outcome="not_owner") >= before + len(blocks)

        await eventually(received, what=f"b receives {wid}'s batches")


async def _reconnected(b: Stack, worker: FakeWorker) -> None:
    """Publish empty batches until b receives one from the worker's new publisher."""
    before = b.count("batches", worker=worker.worker_id, outcome="not_owner")

    async def received() -> bool:
        if b.count("batches", worker=worker.worker_id, outcome="not_owner") > before:
            return True
        worker.publish()
        return False

    await eventually(received, what=f"b reconnects to {worker.worker_id}")


async def _kept(b: Stack, share: set[str]) -> bool:
    return all(b.count("batches", worker=w, outcome="not_owner") >= 2 for w in share)


def test_a_restart_while_the_lease_moves_clears_the_old_entries(
    redis_url: str, namespace: str
) -> None:
    """The publisher restarts after the handoff: the new holder saw the seq drop before it
    held the lease, kept it in order with the batches, and clears the old lifetime's
    entries when it takes the lease."""

    async def main() -> None:
        async with (
            fake_workers(*(FakeWorker(w) for w in IDS)) as workers,
            stack(redis_url, namespace, [w.record() for w in workers], owner="a", **BY_HAND) as a,
        ):
            await cache_first_blocks(a, workers)
            for n, worker in enumerate(workers):  # a long first lifetime: its restart shows
                for _ in range(40):  # as a seq drop, as a real worker's does
                    worker.publish()
                worker.publish(stored(n + 1, 3, 1))
            for n, worker in enumerate(workers):
                await eventually(
                    lookup_is(a.index, n + 1, {worker.worker_id: match(4)}), what="applied"
                )
            async with stack(redis_url, namespace, [], owner="b", **BY_HAND) as b:
                share = await hand_over(a, b, workers)
                for n, worker in enumerate(workers):
                    worker.restart_publisher()  # a new lifetime: seq 0, cache empty
                    await _reconnected(b, worker)
                    worker.publish(stored(100 + n, 0, 2))
                    worker.publish(stored(100 + n, 2, 1))
                await take_over(b, share)
                for wid in share:  # the old lifetime's entries left at the takeover
                    assert b.count("resets", worker=wid) == 1
                for worker in workers:  # the batches kept (or replayed) go in before it
                    worker.publish()
                await eventually(lambda: _exact(a, *workers), what="only the new lifetime")

    asyncio.run(main())


def test_a_restarted_router_resumes_its_workers(redis_url: str, namespace: str) -> None:
    async def main() -> None:
        kvroute = FakeWorker("k0")
        async with fake_workers(*vllm_workers(), kvroute) as everyone:
            workers, records = everyone[:-1], [w.record() for w in everyone]
            async with stack(redis_url, namespace, records, owner="a") as a:
                await cache_first_blocks(a, workers)
                await a.handshake(kvroute)
                kvroute.publish(stored(50, 0, 4))
                await eventually(lambda: _exact(a, kvroute), what="kvroute worker indexed")
            # The last router parked its leases: the next one to start (any id) resumes.
            async with stack(redis_url, namespace, records, owner="c") as again:
                assert set(again.ingest.owned_workers) == {w.worker_id for w in everyone}
                await again.handshake(*everyone)
                await extend_and_check(again, workers)
                kvroute.publish(stored(50, 4, 2))
                await eventually(lambda: _exact(again, kvroute), what="kvroute worker exact")
                for worker in everyone:
                    wid = worker.worker_id
                    assert again.count("handoffs", worker=wid, outcome="resumed") == 1
                    assert again.total("resyncs", worker=wid) == 0
                assert again.total("snapshots", worker="k0") == 0  # resumed, not reloaded

    asyncio.run(main())


def test_a_stale_or_unreadable_handoff_means_a_rebuild(redis_url: str, namespace: str) -> None:
    """A handoff is valid only for the acquisition right after it: if anyone held the lease
    in between (here: another instance under the same id), or it cannot be read, the worker
    is rebuilt from its snapshot instead, and the index is exact either way."""

    async def main() -> None:
        async with fake_workers(FakeWorker("k0"), FakeWorker("k1")) as workers:
            records = [w.record() for w in workers]
            async with stack(redis_url, namespace, records, owner="a") as a:
                await a.handshake(*workers)
                for n, worker in enumerate(workers):
                    worker.publish(stored(60 + n, 0, 4))
                await eventually(lambda: _exact(a, *workers), what="indexed")
            client = await connect(redis_url)
            try:
                layout = KeyLayout(namespace)
                between = WorkerRegistry(client, layout, owner="a")
                lease = await between.acquire(WorkerId("k0"))
                assert lease is not None
                await between.release(lease)
                await client.set(layout.handoff(WorkerId("k1")), b"\x93not a handoff")
            finally:
                await client.aclose()
            async with stack(redis_url, namespace, records, owner="a") as again:
                assert again.count("handoffs", worker="k0", outcome="stale") == 1
                assert again.count("handoffs", worker="k1", outcome="invalid") == 1
                assert again.count("snapshots", worker="k0", outcome="ok") == 1
                assert again.count("snapshots", worker="k1", outcome="ok") == 1
                await again.handshake(*workers)
                for n, worker in enumerate(workers):
                    worker.publish(stored(60 + n, 4, 2))
                await eventually(lambda: _exact(again, *workers), what="exact after rebuild")

    asyncio.run(main())


async def _exact(s: Stack, *workers: FakeWorker) -> bool:
    return await divergent(s.index, *workers) == 0


def test_a_state_too_large_for_redis_falls_back_to_a_rebuild(
    private_redis: RedisServer, namespace: str
) -> None:
    """Handing the state on fails (here: over Redis's 1 MB bulk limit): the lease is
    released plainly and the next router rebuilds the worker from its snapshot, exactly."""

    async def main() -> None:
        client = await connect(private_redis.url)
        await client.config_set("proto-max-bulk-len", 1024 * 1024)
        await client.aclose()
        async with fake_workers(FakeWorker("k0")) as (k0,):
            async with stack(private_redis.url, namespace, [k0.record()], owner="a") as a:
                await a.handshake(k0)
                for first in range(1, 2001, 100):  # 2,000 prompts x 12 blocks
                    k0.publish(*(stored(p, 0, 12) for p in range(first, first + 100)))
                await eventually(lambda: _exact(a, k0), what="24,000 blocks indexed")
            assert a.count("handoffs", worker="k0", outcome="sent") == 0
            async with stack(private_redis.url, namespace, [k0.record()], owner="b") as b:
                assert b.count("snapshots", worker="k0", outcome="ok") == 1
                assert await divergent(b.index, k0) == 0

    asyncio.run(main())
