"""EventPublisher over real sockets: wire bytes, replay protocol, drops; endpoint helpers."""

from __future__ import annotations

import time

import pytest
import zmq

from events.endpoints import (
    Endpoint,
    EndpointError,
    check_data_parallel_ports,
    data_parallel_endpoint,
    tcp_port,
)
from events.framing import END_OF_REPLAY_SEQ, pack_seq
from events.publisher import EventPublisher, PublisherClosedError, PublisherConfig
from events.schema import encode_batch
from tests.support.event_streams import batch, loopback_publisher

POLL_MS = 30_000


def replay(address: str, from_seq: int, *, rcvhwm: int = 1000) -> list[list[bytes]]:
    """Every reply to one replay request, end marker included."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvhwm = rcvhwm
    try:
        dealer.connect(address)
        dealer.send_multipart([b"", pack_seq(from_seq)])
        replies = []
        while True:
            assert dealer.poll(POLL_MS), "no replay reply"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_OF_REPLAY_SEQ:
                return replies
    finally:
        dealer.close()
        ctx.term()


def test_replay_is_byte_compatible_with_vllm() -> None:
    with loopback_publisher(topic=b"kv@w1") as pub:
        assert pub.replay_address is not None
        batches = [batch(i) for i in range(3)]
        for b in batches:
            assert pub.publish(b) is True
        replies = replay(pub.replay_address, 0)
    assert replies == [
        [b"", b"kv@w1", pack_seq(seq), encode_batch(b)] for seq, b in enumerate(batches)
    ] + [[b"", b"", b"\xff" * 8, b""]]


def test_replay_starts_at_requested_seq_or_the_oldest_buffered() -> None:
    with loopback_publisher(buffer_steps=3) as pub:
        assert pub.replay_address is not None
        for i in range(6):
            pub.publish(batch(i))
        assert [r[2] for r in replay(pub.replay_address, 4)] == [
            pack_seq(4),
            pack_seq(5),
            END_OF_REPLAY_SEQ,
        ]
        # Seq 0 left the buffer: the replay silently begins at the oldest one (vLLM).
        assert [r[2] for r in replay(pub.replay_address, 0)] == [
            pack_seq(3),
            pack_seq(4),
            pack_seq(5),
            END_OF_REPLAY_SEQ,
        ]
        assert [r[2] for r in replay(pub.replay_address, 6)] == [END_OF_REPLAY_SEQ]
        assert pub.num_replays == 3


def test_malformed_replay_requests_are_ignored() -> None:
    with loopback_publisher() as pub:
        assert pub.replay_address is not None
        pub.publish(batch(0))
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            dealer.connect(pub.replay_address)
            dealer.send_multipart([b"", b"\x01"])  # 1-byte seq
            dealer.send_multipart([b"x", pack_seq(0)])  # no empty delimiter
            dealer.send_multipart([b"", pack_seq(0)])
            assert dealer.poll(POLL_MS)
            # The only answer is to the valid request.
            assert dealer.recv_multipart()[2] == pack_seq(0)
            assert dealer.poll(POLL_MS)
            assert dealer.recv_multipart()[2] == END_OF_REPLAY_SEQ
        finally:
            dealer.close()
            ctx.term()
        assert pub.num_replays == 1


def test_live_messages_are_topic_seq_payload() -> None:
    with loopback_publisher(topic=b"t") as pub:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.subscribe(b"")
        try:
            sub.connect(pub.address)
            while not sub.poll(50):  # slow-joiner handshake: probe until one arrives
                pub.publish(batch(0))
            first = sub.recv_multipart()
            assert first[0] == b"t" and first[2] == encode_batch(batch(0))
            pub.publish(batch(1))
            while True:
                assert sub.poll(POLL_MS)
                frames = sub.recv_multipart()
                if frames[2] == encode_batch(batch(1)):
                    break
            assert frames == [b"t", pack_seq(pub.next_seq - 1), encode_batch(batch(1))]
        finally:
            sub.close()
            ctx.term()


def test_full_queue_drops_without_blocking_and_consumes_seqs() -> None:
    with loopback_publisher(max_queue_size=1, buffer_steps=20_000) as pub:
        assert pub.replay_address is not None
        accepted = [pub.publish(batch(i)) for i in range(10_000)]
        replies = replay(pub.replay_address, 0)
    assert pub.num_dropped == accepted.count(False) > 0
    assert pub.num_published == accepted.count(True)
    assert pub.next_seq == 10_000
    # A dropped batch's seq is never sent: subscribers see the loss as a gap.
    buffered = [int.from_bytes(r[2], "big") for r in replies[:-1]]
    assert buffered == [seq for seq, ok in enumerate(accepted) if ok]


def test_an_unencodable_batch_is_dropped_and_its_seq_never_sent() -> None:
    with loopback_publisher() as pub:
        assert pub.replay_address is not None
        bad = batch(1)
        bad.events[0].token_ids = [object()]  # type: ignore[attr-defined, list-item]
        pub.publish(batch(0))
        pub.publish(bad)
        pub.publish(batch(2))
        replies = replay(pub.replay_address, 0)
        assert [r[2] for r in replies] == [pack_seq(0), pack_seq(2), END_OF_REPLAY_SEQ]
        assert (pub.num_published, pub.num_dropped) == (2, 1)
        assert pub.publish(batch(3)) is True


@pytest.mark.slow
def test_a_full_buffer_replays_untruncated_to_a_slow_reader() -> None:
    # The reader holds one message at a time: the publisher's replay HWM of
    # 2 * (buffer_steps + 1) must absorb the whole buffer, or replies are lost.
    with loopback_publisher(buffer_steps=10_000, max_queue_size=10_000) as pub:
        assert pub.replay_address is not None
        for i in range(10_000):
            assert pub.publish(batch(i))
        deadline = time.monotonic() + POLL_MS / 1000
        while pub.num_published < 10_000:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling a counter with a deadline
        replies = replay(pub.replay_address, 0, rcvhwm=1)
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == list(range(10_000))
    assert replies[-1][2] == END_OF_REPLAY_SEQ


def test_skip_live_seqs_still_buffers_for_replay() -> None:
    with loopback_publisher(skip_live_seqs={1}) as pub:
        assert pub.replay_address is not None
        for i in range(3):
            pub.publish(batch(i))
        assert [r[2] for r in replay(pub.replay_address, 0)][:3] == [
            pack_seq(0),
            pack_seq(1),
            pack_seq(2),
        ]
        assert pub.num_published == 3


def test_close_sends_the_queue_then_rejects_publish() -> None:
    pub = loopback_publisher(replay=False)
    for i in range(500):
        pub.publish(batch(i))
    pub.close()
    pub.close()
    assert pub.num_published + pub.num_dropped == 500
    with pytest.raises(PublisherClosedError):
        pub.publish(batch(0))


def test_bind_conflict_is_a_clear_error() -> None:
    with (
        loopback_publisher(replay=False) as pub,
        pytest.raises(EndpointError, match="cannot bind"),
    ):
        EventPublisher(PublisherConfig(endpoint=Endpoint.binding(pub.address)))


def test_config_validation_and_replay_hwm() -> None:
    assert PublisherConfig(buffer_steps=10_000).replay_hwm == 20_002
    with pytest.raises(ValueError, match="buffer_steps"):
        PublisherConfig(buffer_steps=0)
    with pytest.raises(EndpointError, match="must start with"):
        Endpoint.binding("127.0.0.1:5557")


def test_data_parallel_endpoints() -> None:
    assert data_parallel_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert data_parallel_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert data_parallel_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert data_parallel_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv-dp2"
    assert Endpoint.binding("tcp://*:5557").for_rank(1) == Endpoint.binding("tcp://*:5558")
    assert tcp_port("tcp://127.0.0.1:5557") == 5557
    assert tcp_port("ipc:///tmp/kv") is None
    with pytest.raises(EndpointError, match="numeric tcp port"):
        data_parallel_endpoint("tcp://127.0.0.1:*", 1)
    with pytest.raises(EndpointError, match=">= 0"):
        data_parallel_endpoint("tcp://127.0.0.1:5557", -1)
    # vLLM's documented 5557/5558 pair collides from rank 1 on.
    check_data_parallel_ports("tcp://*:5557", "tcp://*:5558", 1)
    with pytest.raises(EndpointError, match="use replay port >= 5559"):
        check_data_parallel_ports("tcp://*:5557", "tcp://*:5558", 2)
    check_data_parallel_ports("tcp://*:5557", "tcp://*:5559", 2)
