"""A worker's live stream sent by the test through its own XPUB socket.

The worker's publisher keeps every batch for replay but sends none live (:class:`EverySeq`
as its ``skip_live_seqs``); the test relays the batches it wants delivered through a
:class:`LiveRelay` bound where the router subscribes. An XPUB socket sees the subscriber's
subscription arrive, so the test knows the router is connected before it sends: which
batches reach the router is decided by the test, never by a slow joiner.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import zmq

from events.framing import make_message
from events.schema import KVEventBatch, encode_batch

SUBSCRIBE_TIMEOUT_S = 60.0


class EverySeq:
    """Contains every seq: the worker's publisher sends nothing live (the relay does)."""

    def __contains__(self, seq: object) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


class LiveRelay:
    """An XPUB socket on a loopback port that stays the same across :meth:`restart`.

    Args:
        port: The port to bind (0: a free one).
    """

    def __init__(self, port: int = 0) -> None:
        self._context = zmq.Context()
        self._sock = self._bind(port)
        self.port = int(str(self._sock.last_endpoint.decode()).rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        """Where the router subscribes (the worker's events endpoint)."""
        return f"tcp://127.0.0.1:{self.port}"

    def _bind(self, port: int) -> zmq.Socket[bytes]:
        """Bind an XPUB socket to ``port``; a port just released may still be held by the
        closing socket's listener (ZeroMQ closes it in its I/O thread), so retry."""
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
        while True:
            sock = self._context.socket(zmq.XPUB)
            sock.linger = 0
            try:
                sock.bind(f"tcp://127.0.0.1:{port or '*'}")
                return sock
            except zmq.ZMQError:
                sock.close(linger=0)
                if port == 0 or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)  # polling for the old listener to close

    def wait_subscribed(self, timeout_s: float = SUBSCRIBE_TIMEOUT_S) -> None:
        """Block until a subscriber's subscription reaches this socket."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, "nobody subscribed to the relay"
            if self._sock.poll(min(left_ms, 100)) and self._sock.recv()[:1] == b"\x01":
                return

    def send(self, seq: int, batch: KVEventBatch | None) -> None:
        """Send batch ``seq`` live (the worker's ``last_batch``; ``None``: an empty one)."""
        batch = batch if batch is not None else KVEventBatch(ts=time.time(), events=[])
        self._sock.send_multipart(make_message(b"", seq, encode_batch(batch)))

    def restart(self) -> None:
        """Close the socket (subscribers see the connection drop) and bind a new one on
        the same port."""
        self._sock.close(linger=0)
        self._sock = self._bind(self.port)

    def close(self) -> None:
        self._context.destroy(linger=0)

    def __enter__(self) -> LiveRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
