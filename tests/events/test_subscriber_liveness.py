"""EventSubscriber's hooks for connection liveness, over real ZeroMQ sockets: a catch-up
replay from the last seq (nothing when nothing was missed, the missed batches otherwise),
resubscribing (the stream goes on), and the report of a connection made again."""

from __future__ import annotations

import asyncio

from events.endpoints import Endpoint
from events.identity import WorkerId
from events.publisher import EventPublisher, PublisherConfig
from events.subscriber import EventSubscriber, WorkerStream
from tests.support.event_streams import (
    RecordingSink,
    batch,
    batch_id,
    handshake,
    loopback_publisher,
)
from tests.support.polling import eventually

W0 = WorkerId("w0")


def test_a_catch_up_brings_only_what_was_missed() -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with loopback_publisher(skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream(W0, pub.address, pub.replay_address))
                last = await handshake(sink, W0, lambda: pub.publish(batch(0)))
                assert await sub.catch_up(W0, last + 1) == 0  # nothing was missed
                skipped.update({last + 1, last + 2})
                pub.publish(batch(1))
                pub.publish(batch(2))  # both lost live; nothing follows them

                async def published() -> bool:
                    return pub.num_published == last + 3

                await eventually(published, what="both batches published")
                assert await sub.catch_up(W0, last + 1) == 2
                assert [batch_id(b) for b in sink.batches[-2:]] == [1, 2]
                assert [b.replayed for b in sink.batches[-2:]] == [True, True]
                assert sub.last_seq(W0) == last + 2
                assert await sub.catch_up(W0, last + 3) == 0
                assert sub.counters(W0).num_gaps == 0
                assert not [c for c in sink.calls if c[0] == "resync"]

    asyncio.run(scenario())


def test_without_a_replay_endpoint_a_catch_up_cannot_tell() -> None:
    async def scenario() -> None:
        with loopback_publisher(replay=False) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream(W0, pub.address))
                assert await sub.catch_up(W0, 0) is None
                assert sub.counters(W0).num_replays == 0

    asyncio.run(scenario())


def test_a_resubscribed_stream_goes_on_and_reports_its_reconnection() -> None:
    async def scenario() -> None:
        with loopback_publisher() as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream(W0, pub.address, pub.replay_address))
                await handshake(sink, W0, lambda: pub.publish(batch(0)))
                assert not sub.take_reconnected(W0)  # the first connection is no reconnection
                assert sub.idle_s(W0) >= 0.0
                sub.resubscribe(W0)
                assert sub.counters(W0).num_resubscribes == 1
                assert sub.idle_s(W0) < 5.0  # counted from the resubscription
                seen = len(sink.batches)
                # Probes until one arrives on the new connection; a probe lost while it
                # was being made shows as a gap, replayed.
                await sink.wait_for(
                    lambda: len(sink.batches) > seen, poke=lambda: pub.publish(batch(1))
                )
                seqs = sink.seqs(W0)
                assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost

    asyncio.run(scenario())


def test_a_connection_that_dropped_and_was_made_again_is_reported_once() -> None:
    async def scenario() -> None:
        first = loopback_publisher()
        sink = RecordingSink()
        async with EventSubscriber(sink) as sub:
            await sub.add_worker(WorkerStream(W0, first.address, first.replay_address))
            await handshake(sink, W0, lambda: first.publish(batch(0)))
            address = first.address
            first.close()  # the worker goes away and comes back on the same address
            with EventPublisher(PublisherConfig(endpoint=Endpoint.binding(address))):

                async def reconnected() -> bool:
                    return sub.take_reconnected(W0)

                await eventually(reconnected, what="the reconnection reported")
                assert not sub.take_reconnected(W0)  # once

    asyncio.run(scenario())
