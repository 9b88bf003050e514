"""EventSubscriber over real ZeroMQ sockets: ordering, gaps, replay, resets, resyncs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.endpoints import Endpoint
from events.framing import make_message
from events.publisher import EventPublisher, PublisherConfig
from events.schema import BlockRemoved, BlockStored, encode_batch
from events.subscriber import (
    EventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    SubscriberError,
    WorkerStream,
)
from tests.support.event_streams import (
    DEADLINE_S,
    RecordingSink,
    batch,
    batch_id,
    handshake,
    loopback_publisher,
)
from tests.support.polling import wait_until


def stream_of(publisher: EventPublisher, worker_id: str = "w0", **kw: object) -> WorkerStream:
    return WorkerStream(worker_id, publisher.address, publisher.replay_address, **kw)  # type: ignore[arg-type]


async def wait_last_seq(sub: EventSubscriber, sink: RecordingSink, worker: str, seq: int) -> None:
    await sink.wait_for(lambda: sub.last_seq(worker) == seq)


def test_loss_injection_applied_sequence_equals_published() -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with loopback_publisher(skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(stream_of(pub))
                n = 0

                def probe() -> None:
                    nonlocal n
                    pub.publish(batch(n))
                    n += 1

                await handshake(sink, "w0", probe)
                # Rounds of 10 batches, each losing one run on PUB: a single batch, a run
                # of 5, the round's first batch, and its second to last.
                for offset, length in ((3, 1), (2, 5), (0, 1), (8, 1)):
                    start = pub.next_seq
                    skipped.update(range(start + offset, start + offset + length))
                    for _ in range(10):
                        probe()
                    await wait_last_seq(sub, sink, "w0", pub.next_seq - 1)
                first = sink.batches[0].seq
                assert sink.seqs("w0") == list(range(first, pub.next_seq))
                assert [batch_id(b) for b in sink.batches] == list(range(first, pub.next_seq))
                assert [c[0] for c in sink.calls] == ["batch"] * len(sink.batches)
                counters = sub.counters("w0")
                assert (counters.num_gaps, counters.num_replays, counters.num_missed) == (4, 4, 8)
                assert counters.resyncs == {}
                assert counters.num_batches == pub.next_seq - first
                assert all(b.replayed for b in sink.batches if b.seq in skipped)

    asyncio.run(scenario())


def test_buffer_overrun_signals_resync_and_continues_live() -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with loopback_publisher(buffer_steps=4, skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                start = pub.next_seq
                skipped.update(range(start, start + 10))
                for i in range(12):
                    pub.publish(batch(i))
                await wait_last_seq(sub, sink, "w0", start + 11)
                assert ("resync", "w0", "replay_buffer_overrun") in sink.calls
                assert sink.seqs("w0")[-2:] == [start + 10, start + 11]
                assert sub.counters("w0").resyncs == {"replay_buffer_overrun": 1}
                assert start + 9 not in sink.seqs("w0")

    asyncio.run(scenario())


def test_publisher_restart_signals_reset_then_replays_new_lifetime(tmp_path: Path) -> None:
    config = PublisherConfig(
        endpoint=Endpoint.binding(f"ipc://{tmp_path}/pub"),
        replay_endpoint=Endpoint.binding(f"ipc://{tmp_path}/replay"),
    )

    async def scenario() -> None:
        sink = RecordingSink()
        async with EventSubscriber(sink) as sub:
            with EventPublisher(config) as first:
                await sub.add_worker(stream_of(first))
                await handshake(sink, "w0", lambda: first.publish(batch(0)))
                while first.next_seq < 50:
                    first.publish(batch(1))
                await wait_last_seq(sub, sink, "w0", 49)
            with EventPublisher(config) as second:
                await sink.wait_for(
                    lambda: any(c[0] == "reset" for c in sink.calls),
                    poke=lambda: second.publish(batch(2)),
                )
                reset_at = next(i for i, c in enumerate(sink.calls) if c[0] == "reset")
                reset_seq = sink.calls[reset_at][2]
                assert reset_seq < 50
                for _ in range(5):
                    second.publish(batch(3))
                await wait_last_seq(sub, sink, "w0", second.next_seq - 1)
                after = sink.calls[reset_at + 1 :]
                # The new lifetime is delivered from seq 0, batches missed while
                # reconnecting coming through replay.
                assert after == [("batch", "w0", s) for s in range(second.next_seq)]
                assert sub.counters("w0").num_resets == 1

    asyncio.run(scenario())


@pytest.mark.slow
def test_replay_endpoint_down_resyncs_after_bounded_timeout_without_stalling_others(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with (
            loopback_publisher(replay=False, skip_live_seqs=skipped) as lossy,
            loopback_publisher() as healthy,
        ):
            sink = RecordingSink()
            config = SubscriberConfig(replay_timeout_s=1.0)
            async with EventSubscriber(sink, config) as sub:
                dead_replay = f"ipc://{tmp_path}/nobody-listens"
                await sub.add_worker(WorkerStream("lossy", lossy.address, dead_replay))
                await sub.add_worker(stream_of(healthy, "healthy"))
                await handshake(sink, "lossy", lambda: lossy.publish(batch(0)))
                await handshake(sink, "healthy", lambda: healthy.publish(batch(0)))
                skipped.add(lossy.next_seq)
                lossy.publish(batch(1))
                lossy.publish(batch(2))  # reveals the gap; its replay hangs
                began = time.monotonic()
                await sink.wait_for(lambda: sub.counters("lossy").num_replays == 1)
                # The other worker keeps flowing while the replay waits.
                target = healthy.next_seq + 20
                while healthy.next_seq < target:
                    healthy.publish(batch(3))
                await wait_last_seq(sub, sink, "healthy", target - 1)
                await sink.wait_for(lambda: ("resync", "lossy", "replay_timeout") in sink.calls)
                assert time.monotonic() - began < 1.0 + DEADLINE_S / 2
                await wait_last_seq(sub, sink, "lossy", lossy.next_seq - 1)
                assert sub.counters("lossy").resyncs == {"replay_timeout": 1}

    asyncio.run(scenario())


def test_no_replay_endpoint_resyncs_immediately() -> None:
    async def scenario() -> None:
        skipped: set[int] = set()
        with loopback_publisher(replay=False, skip_live_seqs=skipped) as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                skipped.add(pub.next_seq)
                pub.publish(batch(1))
                pub.publish(batch(2))
                await wait_last_seq(sub, sink, "w0", pub.next_seq - 1)
                assert sink.calls[-2:] == [
                    ("resync", "w0", "no_replay_endpoint"),
                    ("batch", "w0", pub.next_seq - 1),
                ]

    asyncio.run(scenario())


def test_malformed_messages_are_counted_and_skipped() -> None:
    async def scenario() -> None:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUB)
        raw.linger = 0
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        sink = RecordingSink()
        seq = 0

        def send_valid() -> None:
            nonlocal seq
            raw.send_multipart(make_message(b"", seq, encode_batch(batch(seq))))
            seq += 1

        try:
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(WorkerStream("raw", f"tcp://127.0.0.1:{port}"))
                await handshake(sink, "raw", send_valid)
                bad_msgpack = make_message(b"", seq, b"\xc1")
                unknown_tag = make_message(
                    b"", seq + 1, msgspec.msgpack.encode([1.0, [{"type": "Future"}], 0])
                )
                raw.send_multipart([b"", b"\x00" * 8])  # two frames
                raw.send_multipart([b"", b"\x01", b"payload"])  # 1-byte seq
                raw.send_multipart(bad_msgpack)
                raw.send_multipart(unknown_tag)
                seq += 2
                send_valid()
                await wait_last_seq(sub, sink, "raw", seq - 1)
                counters = sub.counters("raw")
                assert counters.malformed == {
                    "bad_frames": 1,
                    "bad_seq": 1,
                    "msgpack": 1,
                    "unknown_tag": 1,
                }
                assert counters.num_gaps == 0
                # The undecodable batch lost its events for good: resync. The unknown
                # event was skipped and the rest of its (empty) batch delivered.
                assert counters.resyncs == {"undecodable_batch": 1}
                assert ("resync", "raw", "undecodable_batch") in sink.calls
                assert [b.seq for b in sink.batches[-2:]] == [seq - 2, seq - 1]
                assert sink.batches[-2].batch.events == []
        finally:
            raw.close()
            ctx.term()

    asyncio.run(scenario())


def test_legacy_array_and_map_publishers_side_by_side() -> None:
    async def scenario() -> None:
        ctx = zmq.Context()
        legacy = ctx.socket(zmq.PUB)
        legacy.linger = 0
        port = legacy.bind_to_random_port("tcp://127.0.0.1")
        seq = 0

        def send_legacy() -> None:
            nonlocal seq
            event = [
                "BlockStored",
                [seq],
                None,
                [1, 2, 3, 4],
                4,
                None,
                "GPU",
                None,
                [None],
                0,
                "full_attention",
                None,
            ]
            payload = msgspec.msgpack.encode([1.5, [event, ["BlockRemoved", [seq], "GPU", 0]]])
            legacy.send_multipart(make_message(b"kv", seq, payload))
            seq += 1

        sink = RecordingSink()
        try:
            with loopback_publisher(topic=b"kv") as modern:
                async with EventSubscriber(sink) as sub:
                    await sub.add_worker(WorkerStream("legacy", f"tcp://127.0.0.1:{port}"))
                    await sub.add_worker(stream_of(modern, "modern", topic=b"kv"))
                    await handshake(sink, "legacy", send_legacy)
                    await handshake(sink, "modern", lambda: modern.publish(batch(7)))
                    send_legacy()
                    modern.publish(batch(8))
                    await wait_last_seq(sub, sink, "legacy", seq - 1)
                    await wait_last_seq(sub, sink, "modern", modern.next_seq - 1)
        finally:
            legacy.close()
            ctx.term()
        old = [b for b in sink.batches if b.worker_id == "legacy"][-1]
        stored, removed = old.batch.events
        assert isinstance(stored, BlockStored)
        assert removed == BlockRemoved(block_hashes=[seq - 1], medium="GPU", group_idx=0)
        assert (stored.block_hashes, stored.token_ids, stored.medium) == (
            [seq - 1],
            [1, 2, 3, 4],
            "GPU",
        )
        assert stored.kv_cache_spec_kind == "full_attention"
        assert old.batch.data_parallel_rank is None
        new = [b for b in sink.batches if b.worker_id == "modern"][-1]
        assert batch_id(new) == 8
        assert new.batch == batch(8)

    asyncio.run(scenario())


def test_request_replay_redelivers_from_inside_the_sink_and_reports_overrun() -> None:
    class ReplayingSink(RecordingSink):
        sub: EventSubscriber | None = None
        replay_from: int | None = None
        results: list[bool] = []

        async def on_batch(self, received: ReceivedBatch) -> None:
            await super().on_batch(received)
            if self.replay_from is not None and not received.replayed:
                from_seq, self.replay_from = self.replay_from, None
                assert self.sub is not None
                self.results.append(await self.sub.request_replay("w0", from_seq))

    async def scenario() -> None:
        with loopback_publisher(buffer_steps=100) as pub:
            sink = ReplayingSink()
            sink.results = []
            async with EventSubscriber(sink) as sub:
                sink.sub = sub
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                first = sink.batches[0].seq
                # From outside the reader task.
                assert await sub.request_replay("w0", first) is True
                last = sub.last_seq("w0")
                assert last is not None
                assert [(b.seq, b.replayed) for b in sink.batches[-(last - first + 1) :]] == [
                    (s, True) for s in range(first, last + 1)
                ]
                # From inside on_batch (the reader task itself).
                sink.replay_from = last
                pub.publish(batch(1))
                await sink.wait_for(lambda: len(sink.results) == 1)
                assert sink.results == [True]
                assert sink.seqs("w0")[-3:] == [last + 1, last, last + 1]
                # Older than the buffer: impossible, resync.
                while pub.next_seq < first + 150:
                    pub.publish(batch(2))
                await wait_last_seq(sub, sink, "w0", pub.next_seq - 1)
                assert await sub.request_replay("w0", first) is False
                assert sink.calls[-1] == ("resync", "w0", "replay_buffer_overrun")
                with pytest.raises(SubscriberError):
                    await sub.request_replay("nobody", 0)

    asyncio.run(scenario())


def test_late_joiner_catches_up_through_replay_then_goes_live() -> None:
    async def scenario() -> None:
        with loopback_publisher() as pub:
            for i in range(5):
                pub.publish(batch(i))
            # In its replay ring before anyone asks (its thread sends them, not publish()).
            wait_until(lambda: pub.num_published == 5, "the publisher to send its batches")
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(stream_of(pub))
                assert await sub.request_replay("w0", 0) is True
                assert [(b.seq, b.replayed) for b in sink.batches] == [(s, True) for s in range(5)]
                # Live batches the replay already delivered are duplicates, not a restart.
                await sink.wait_for(
                    lambda: len(sink.batches) > 5, poke=lambda: pub.publish(batch(9))
                )
                assert sink.seqs("w0") == list(range(len(sink.batches)))
                assert sub.counters("w0").num_resets == 0

    asyncio.run(scenario())


def test_request_replay_never_skips_and_nothing_new_is_success() -> None:
    async def scenario() -> None:
        with loopback_publisher() as pub:
            sink = RecordingSink()
            async with EventSubscriber(sink) as sub:
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                await sink.wait_for(lambda: sub.last_seq("w0") == pub.next_seq - 1)
                last = pub.next_seq - 1
                before = len(sink.calls)
                # Nothing after the last delivered batch: an empty replay succeeds.
                assert await sub.request_replay("w0", last + 1) is True
                # A start beyond the next undelivered seq is lowered to it.
                assert await sub.request_replay("w0", last + 100) is True
                assert sink.calls[before:] == []
                assert sub.counters("w0").resyncs == {}

    asyncio.run(scenario())


def test_add_and_remove_workers() -> None:
    async def scenario() -> None:
        with loopback_publisher() as pub:
            sink = RecordingSink()
            sub = EventSubscriber(sink)
            runner = asyncio.create_task(sub.run())
            await sub.add_worker(stream_of(pub, "a"))
            with pytest.raises(SubscriberError):
                await sub.add_worker(stream_of(pub, "a"))
            await sub.add_worker(stream_of(pub, "b"))
            await handshake(sink, "a", lambda: pub.publish(batch(0)))
            await handshake(sink, "b", lambda: pub.publish(batch(0)))
            assert sub.worker_ids == ["a", "b"]
            await sub.remove_worker("a")
            assert sub.worker_ids == ["b"]
            with pytest.raises(SubscriberError):
                sub.last_seq("a")
            await sub.close()
            await asyncio.wait_for(runner, DEADLINE_S)

    asyncio.run(scenario())


def test_remove_worker_from_its_own_sink_call_is_refused() -> None:
    class RemovingSink(RecordingSink):
        sub: EventSubscriber | None = None
        errors: list[str] = []

        async def on_batch(self, received: ReceivedBatch) -> None:
            assert self.sub is not None
            try:
                await self.sub.remove_worker(received.worker_id)
            except SubscriberError as exc:
                self.errors.append(str(exc))
            await super().on_batch(received)

    async def scenario() -> None:
        with loopback_publisher() as pub:
            sink = RemovingSink()
            sink.errors = []
            async with EventSubscriber(sink) as sub:
                sink.sub = sub
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                assert "from inside that worker's sink call" in sink.errors[0]
                assert sub.worker_ids == ["w0"]

    asyncio.run(scenario())


def test_sink_failure_surfaces_from_run_when_told_to_stop() -> None:
    class FailingSink(RecordingSink):
        async def on_batch(self, received: ReceivedBatch) -> None:
            raise RuntimeError("index unavailable")

    async def scenario() -> None:
        with loopback_publisher() as pub:
            sub = EventSubscriber(FailingSink(), SubscriberConfig(on_reader_failure="stop"))
            await sub.add_worker(stream_of(pub))
            runner = asyncio.create_task(sub.run())
            deadline = time.monotonic() + DEADLINE_S
            while not runner.done():
                assert time.monotonic() < deadline
                pub.publish(batch(0))
                await asyncio.wait([runner], timeout=0.05)
            with pytest.raises(RuntimeError, match="index unavailable"):
                runner.result()
            assert sub.worker_ids == []

    asyncio.run(scenario())


def test_a_failed_reader_restarts_says_so_and_reads_on(caplog: pytest.LogCaptureFixture) -> None:
    """A sink error kills no stream: the reader is restarted after a backoff, the failure
    logged with the worker id and counted, a resync asked for (the failed batch may be
    lost), and the batches after it delivered."""

    class FailingOnceSink(RecordingSink):
        failed = False

        async def on_batch(self, received: ReceivedBatch) -> None:
            if not self.failed and batch_id(received) == 7:
                self.failed = True
                raise RuntimeError("a bug in the sink")
            await super().on_batch(received)

    async def scenario() -> None:
        with loopback_publisher() as pub:
            sink = FailingOnceSink()
            async with EventSubscriber(sink) as sub:  # the default: restart
                await sub.add_worker(stream_of(pub))
                await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                pub.publish(batch(7))  # the sink fails on it
                n = 8

                def probe() -> None:
                    nonlocal n
                    pub.publish(batch(n))
                    n += 1

                await sink.wait_for(lambda: any(batch_id(b) >= 8 for b in sink.batches), poke=probe)
                counters = sub.counters("w0")
        assert sink.failed
        assert counters.task_restarts == {"reader": 1}
        assert counters.resyncs == {"reader_restarted": 1}
        assert ("resync", "w0", "reader_restarted") in sink.calls
        # The batches after the failure arrive in order, each once.
        after = [batch_id(b) for b in sink.batches if batch_id(b) >= 8]
        assert after == sorted(set(after))
        failures = [r for r in caplog.records if "its reader task failed" in r.getMessage()]
        assert len(failures) == 1 and "w0" in failures[0].getMessage()
        assert failures[0].exc_info is not None

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_trickling_replay_endpoint_is_cut_off_at_the_deadline() -> None:
    """Malformed replies every 0.1 s keep a replay under its silence timeout forever; the
    overall deadline ends it (a resync), and the live stream goes on."""

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        trickler = context.socket(zmq.ROUTER)
        trickler.linger = 0
        port = trickler.bind_to_random_port("tcp://127.0.0.1")

        async def trickle() -> None:
            peers: list[bytes] = []
            while True:
                if await trickler.poll(100):
                    peers.append((await trickler.recv_multipart())[0])
                for peer in peers:
                    await trickler.send_multipart([peer, b"malformed"])

        skipped: set[int] = set()
        task = asyncio.create_task(trickle())
        try:
            with loopback_publisher(skip_live_seqs=skipped) as pub:
                sink = RecordingSink()
                config = SubscriberConfig(replay_timeout_s=1.0, replay_deadline_s=2.0)
                async with EventSubscriber(sink, config) as sub:
                    stream = WorkerStream("w0", pub.address, f"tcp://127.0.0.1:{port}")
                    await sub.add_worker(stream)
                    await handshake(sink, "w0", lambda: pub.publish(batch(0)))
                    skipped.add(pub.next_seq)
                    pub.publish(batch(1))
                    began = time.monotonic()
                    pub.publish(batch(2))  # reveals the gap; the replay trickles
                    await sink.wait_for(
                        lambda: ("resync", "w0", "replay_deadline") in sink.calls
                    )
                    took = time.monotonic() - began
                    pub.publish(batch(3))
                    await sink.wait_for(lambda: 3 in [batch_id(b) for b in sink.batches])
                    counters = sub.counters("w0")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            context.destroy(linger=0)
        assert 2.0 <= took < 2.0 + DEADLINE_S / 2
        assert counters.resyncs == {"replay_deadline": 1}
        assert counters.malformed["bad_replay_frames"] >= 10  # each reply, counted

    asyncio.run(scenario())
