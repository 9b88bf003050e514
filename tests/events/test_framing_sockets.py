"""send_frames / recv_frames: the same messages on the wire as pyzmq's send/recv_multipart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from events.framing import make_message, recv_frames, send_frames

POLL_MS = 30_000
MESSAGES = [
    [b"only"],
    make_message(b"kv@w1", 7, b"payload"),
    [b"", b"", b"\xff" * 8, b"", b"five"],
    [b""],
]


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], ...]]:
    """Two connected PAIR sockets over inproc (the address is private to the context)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://pair")
    b.connect("inproc://pair")
    try:
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_send_frames_matches_recv_multipart(pair: tuple[zmq.Socket[bytes], ...]) -> None:
    a, b = pair
    for frames in MESSAGES:
        send_frames(a, frames)
    send_frames(a, (b"t", b"s", b"p"), zmq.NOBLOCK)  # a zmq.Flag, tuple frames
    for frames in [*MESSAGES, [b"t", b"s", b"p"]]:
        assert b.poll(POLL_MS)
        assert b.recv_multipart() == frames


def test_recv_frames_keeps_message_boundaries(pair: tuple[zmq.Socket[bytes], ...]) -> None:
    a, b = pair
    for frames in MESSAGES:
        a.send_multipart(frames)
    assert b.poll(POLL_MS)
    assert [recv_frames(b, zmq.NOBLOCK) for _ in MESSAGES] == MESSAGES
    with pytest.raises(zmq.Again):
        recv_frames(b, zmq.NOBLOCK)
