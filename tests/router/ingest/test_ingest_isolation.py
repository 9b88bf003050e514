"""Ingest: one worker's broken replay endpoint harms no other worker and kills no stream.

Real publishers, ZeroMQ, HTTP and Redis; the broken endpoints are real sockets too: a
ROUTER that answers a replay request with a malformed reply every 0.2 s forever (each
one resets a per-message timeout), and an address ZeroMQ cannot connect to at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.identity import WorkerId
from tests.support.ingest import (
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

pytestmark = pytest.mark.slow

LEASE_TTL_MS = 1_500
TRICKLE_S = 0.2


async def keeps_its_lease(s: Stack, ok: FakeWorker, holder: str | None) -> None:
    """For three lease TTLs ``ok``'s lease stays with ``holder`` (renewed, never lost) and
    each of its batches reaches the index."""
    end = time.monotonic() + 3 * LEASE_TTL_MS / 1000
    prompt = 10
    while time.monotonic() < end:
        ok.publish(stored(prompt, 0, 2))
        await eventually(lookup_is(s.index, prompt, {ok.worker_id: match(2)}), what=ok.worker_id)
        prompt += 1
    assert await s.registry.holder(WorkerId(ok.worker_id)) == holder
    assert s.count("leases_lost", worker=ok.worker_id) == 0


class TricklingReplayEndpoint:
    """A replay ROUTER socket that answers every request with a malformed reply (one
    frame) every ``TRICKLE_S``, never ending the replay."""

    def __init__(self) -> None:
        self._context = zmq.asyncio.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.linger = 0
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests: list[bytes] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        peers: list[bytes] = []
        while True:
            if await self._sock.poll(int(TRICKLE_S * 1000)):
                identity, *request = await self._sock.recv_multipart()
                self.requests.append(b"".join(request))
                peers.append(identity)
            for peer in peers:
                await self._sock.send_multipart([peer, b"not a replay reply"])

    async def __aenter__(self) -> TricklingReplayEndpoint:
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._context.destroy(linger=0)


def test_a_trickling_replay_endpoint_starves_no_other_lease(redis_url: str, namespace: str) -> None:
    """Worker a-bad meets an unknown parent: its ingest asks for a replay from seq 0, and
    its replay endpoint trickles malformed replies. For three lease TTLs b-ok's lease is
    renewed (never lost, same epoch) and each of its batches reaches the index."""

    async def main() -> None:
        async with (
            TricklingReplayEndpoint() as trickler,
            fake_workers(FakeWorker("a-bad"), FakeWorker("b-ok")) as (bad, ok),
            stack(redis_url, namespace, lease_ttl_ms=LEASE_TTL_MS, maintain_interval_s=0.3) as s,
        ):
            bad_record = msgspec.structs.replace(bad.record(), replay_endpoint=trickler.address)
            await s.ingest.start([bad_record, ok.record()])  # a-bad comes first in a pass
            await s.handshake(bad, ok)
            holder = await s.registry.holder(WorkerId("b-ok"))
            bad.publish(stored(1, 1, 2))  # its parent was never stored: replay from 0

            async def replay_asked() -> bool:
                return bool(trickler.requests)

            await eventually(replay_asked, what="a-bad's replay request")
            await keeps_its_lease(s, ok, holder)
            assert await divergent(s.index, ok) == 0
            assert len(trickler.requests) == 1  # the replay is still open (no deadline yet)

    asyncio.run(main())


def test_a_replay_address_that_cannot_be_connected_to_kills_no_stream(
    redis_url: str, namespace: str
) -> None:
    """A registered replay address that ZeroMQ refuses at connect time: the gap that needs
    it ends in a resync (from the snapshot), and the stream is read on."""

    async def main() -> None:
        skip: set[int] = set()
        async with (
            fake_workers(FakeWorker("k1", skip_live_seqs=skip)) as (k1,),
            stack(redis_url, namespace) as s,
        ):
            # A name that never resolves: a valid registration, a replay that cannot connect.
            record = msgspec.structs.replace(
                k1.record(), replay_endpoint="tcp://no-such-host.invalid:5557"
            )
            await s.ingest.start([record])
            await s.handshake(k1)
            skip.add(k1.publisher.next_seq)
            k1.publish(stored(1, 0, 2))  # lost live
            k1.publish()  # reveals the gap; its replay cannot connect
            k1.publish(stored(2, 0, 3))  # read and applied after it
            await eventually(lookup_is(s.index, 2, {"k1": match(3)}), what="read on")
            await eventually(lookup_is(s.index, 1, {"k1": match(2)}), what="resynced")
            assert await divergent(s.index, k1) == 0
            resyncs = s.metrics.registry.get_sample_value(
                "kvroute_stream_resyncs_total", {"worker": "k1", "reason": "replay_timeout"}
            )
            assert resyncs == 1
            assert stream_count(s, "gaps", "k1") == 1

    asyncio.run(main())


def test_a_hung_snapshot_endpoint_delays_no_other_worker(redis_url: str, namespace: str) -> None:
    """a-hung restarts unseen and its reset waits on a snapshot that does not come; b-ok
    restarts unseen meanwhile and is reset at once (the same maintenance finds both);
    for three lease TTLs b-ok's lease is renewed and each of its batches reaches the
    index; a-hung's batches published while its snapshot hangs are kept, and applied
    once it comes."""

    async def main() -> None:
        async with (
            fake_workers(LifetimeWorker("a-hung"), LifetimeWorker("b-ok")) as (hung, ok),
            stack(
                redis_url,
                namespace,
                lease_ttl_ms=LEASE_TTL_MS,
                maintain_interval_s=0.3,
                snapshot_timeout_s=600.0,
            ) as s,
        ):
            await s.ingest.start([hung.record(), ok.record()])  # a-hung comes first in a pass
            await s.handshake(hung, ok)
            hung.publish(stored(1, 0, 4))
            ok.publish(stored(2, 0, 4))
            await eventually(lookup_is(s.index, 1, {"a-hung": match(4)}), what="a-hung")
            await eventually(lookup_is(s.index, 2, {"b-ok": match(4)}), what="b-ok")
            holder = await s.registry.holder(WorkerId("b-ok"))
            hung.hold_snapshot = True
            asked = hung.snapshot_requests
            hung.restart_publisher()  # quiet: only the maintenance's lifetime check sees it

            async def snapshot_hangs() -> bool:
                return hung.snapshot_requests > asked

            await eventually(snapshot_hangs, what="a-hung's snapshot request")
            ok.restart_publisher()
            await eventually(lookup_is(s.index, 2, {}), what="b-ok reset meanwhile")
            await s.handshake(ok)
            hung.publish(stored(3, 0, 2))  # its new lifetime's first batch: kept
            await keeps_its_lease(s, ok, holder)
            assert hung.snapshot_requests == asked + 1  # still hanging
            assert dict(await s.index.lookup(keys(3))) == {}
            hung.release_snapshot()
            await eventually(lookup_is(s.index, 3, {"a-hung": match(2)}), what="a-hung's batch")

            async def exact() -> bool:  # the restart it kept is applied after the snapshot
                return await divergent(s.index, hung, ok) == 0

            await eventually(exact, what="the index equal to both workers' caches")
            assert dict(await s.index.lookup(keys(1))) == {}  # its old lifetime is gone

    asyncio.run(main())


def test_a_router_closed_while_a_snapshot_hangs_hands_nothing_half_done_on(
    redis_url: str, namespace: str
) -> None:
    """a-hung's reset waits on its snapshot when router a closes: its lease goes on
    without a handoff (its entries were cleared for the reset), and router b rebuilds
    it from the snapshot, exactly."""

    async def main() -> None:
        async with fake_workers(LifetimeWorker("a-hung")) as (hung,):
            async with stack(redis_url, namespace, [hung.record()], owner="a") as a:
                await a.handshake(hung)
                hung.publish(stored(1, 0, 4))
                await eventually(lookup_is(a.index, 1, {"a-hung": match(4)}), what="indexed")
                hung.hold_snapshot = True
                asked = hung.snapshot_requests
                hung.restart_publisher()  # quiet: the maintenance's lifetime check resets it

                async def snapshot_hangs() -> bool:
                    return hung.snapshot_requests > asked

                await eventually(snapshot_hangs, what="a-hung's snapshot request")
                hung.publish(stored(2, 0, 3))
            assert a.count("handoffs", worker="a-hung", outcome="sent") == 0
            hung.release_snapshot()
            async with stack(redis_url, namespace, [hung.record()], owner="b") as b:
                assert b.count("handoffs", worker="a-hung", outcome="resumed") == 0
                await eventually(lookup_is(b.index, 2, {"a-hung": match(3)}), what="rebuilt")
                assert dict(await b.index.lookup(keys(1))) == {}
                assert await divergent(b.index, hung) == 0

    asyncio.run(main())
