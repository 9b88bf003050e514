"""EventPublisher: publishes KV event batches on ZeroMQ PUB and serves vLLM-style replay.

The caller (a synchronous GPU worker loop) hands batches to :meth:`EventPublisher.publish`,
which never blocks: a bounded queue feeds one background thread that encodes each batch,
sends ``[topic, seq, payload]`` on the PUB socket, keeps the last ``buffer_steps`` batches
in a ring buffer and answers replay requests on an optional ROUTER socket, byte-compatible
with vLLM 0.33 (request ``["", seq8]`` from a DEALER; replies ``["", topic, seq8,
payload]`` for every buffered seq at or after the start, then ``["", "", ff*8, ""]``).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

import msgspec
import zmq

from events.curve import CurveServerConfig, EventAuthenticator, configure_server
from events.endpoints import Endpoint
from events.errors import EventsError, FramingError
from events.framing import END_OF_REPLAY_SEQ, pack_seq, recv_frames, send_frames, unpack_seq
from events.liveness import SocketLiveness, apply_liveness
from events.schema import KVEventBatch, encode_batch

__all__ = ["EventPublisher", "PublisherClosedError", "PublisherConfig"]

_log = logging.getLogger(__name__)

_END_OF_REPLAY: Final = [b"", b"", END_OF_REPLAY_SEQ, b""]


class PublisherClosedError(EventsError, RuntimeError):
    """:meth:`EventPublisher.publish` was called after :meth:`EventPublisher.close`."""


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Settings of one :class:`EventPublisher`.

    Attributes:
        endpoint: Where the PUB socket binds (or connects).
        replay_endpoint: Where the replay ROUTER socket binds; ``None`` disables replay.
        topic: First frame of every message (subscribers prefix-match it).
        buffer_steps: Batches kept for replay (the ring buffer's capacity).
        max_queue_size: Batches waiting for the background thread before
            :meth:`EventPublisher.publish` starts dropping.
        hwm: PUB send high-water mark in messages (past it ZeroMQ drops silently; the
            subscriber sees a gap and replays).
        linger_ms: How long :meth:`EventPublisher.close` lets queued messages drain.
        curve: CURVE server keys and client allow-list for both sockets; ``None`` = plain.
        liveness: Heartbeats and TCP keepalive on both sockets' connections, so a
            subscriber that vanished without closing is dropped (and its queue freed).
    """

    endpoint: Endpoint = field(default_factory=lambda: Endpoint.binding("tcp://127.0.0.1:5557"))
    replay_endpoint: Endpoint | None = None
    topic: bytes = b""
    buffer_steps: int = 10_000
    max_queue_size: int = 10_000
    hwm: int = 100_000
    linger_ms: int = 500
    curve: CurveServerConfig | None = None
    liveness: SocketLiveness = field(default_factory=SocketLiveness)

    def __post_init__(self) -> None:
        if self.buffer_steps < 1 or self.max_queue_size < 1 or self.hwm < 0:
            raise ValueError(
                "buffer_steps and max_queue_size must be >= 1 and hwm >= 0, got "
                f"{self.buffer_steps}, {self.max_queue_size}, {self.hwm}"
            )

    @property
    def replay_hwm(self) -> int:
        """Replay send high-water mark: ``2 * (buffer_steps + 1)``, so replays never truncate."""
        return 2 * (self.buffer_steps + 1)


class EventPublisher:
    """Publishes KV event batches from a synchronous caller through one background thread.

    Sequence numbers follow vLLM: 8 bytes big-endian, from 0 for each publisher lifetime,
    +1 per batch handed to :meth:`publish`.

    NOTE: a batch dropped because the queue was full still consumes its seq, so every
    subscriber sees the loss as a gap that replay cannot close and resyncs that worker;
    assigning seqs only to sent batches would hide the loss.

    Args:
        config: Endpoints, buffer sizes and security.
        skip_live_seqs: Test hook for loss injection: these seqs are buffered for replay but
            never sent on the PUB socket. Membership is checked as each batch is sent, so a
            test may fill a set it passed here after its slow-joiner handshake. Empty in
            production.

    Attributes:
        address: The PUB address in effect (the OS-chosen port of a ``tcp://HOST:*`` bind).
        replay_address: The replay address in effect, ``None`` without replay.

    Raises:
        EndpointError: A socket could not bind or connect.
    """

    def __init__(self, config: PublisherConfig, *, skip_live_seqs: Collection[int] = ()):
        self._config = config
        self._skip_live_seqs = skip_live_seqs
        # NOTE: (seq, batch) pairs; only publish() appends, only the thread pops.
        self._queue: collections.deque[tuple[int, KVEventBatch]] = collections.deque()
        # NOTE: (seq, payload) in increasing seq order, at most buffer_steps entries.
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._next_seq = 0
        self._num_dropped = 0  # NOTE: written by publish() only
        self._num_unencodable = 0  # NOTE: written by the thread only
        self._num_published = 0
        self._num_replays = 0
        self._closed = False
        self._stopping = False
        # NOTE: True only while the thread may block in poll; publish() then writes one
        # byte to the wake pipe. The thread re-checks the queue after setting it.
        self._sleeping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._failed = False
        self._released = False
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth = EventAuthenticator(self._context, config.curve) if config.curve else None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.address, self.replay_address = self._open_sockets()
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"kv-event-publisher[{self.address}]", daemon=True
        )
        self._thread.start()

    def _open_sockets(self) -> tuple[str, str | None]:
        config = self._config
        self._pub = self._context.socket(zmq.PUB)
        self._pub.sndhwm = config.hwm
        self._pub.linger = config.linger_ms
        apply_liveness(self._pub, config.liveness)
        if config.curve is not None:
            configure_server(self._pub, config.curve)
        address = config.endpoint.attach(self._pub)
        if config.replay_endpoint is None:
            return address, None
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.sndhwm = config.replay_hwm
        self._replay.linger = 0
        self._replay.router_mandatory = True
        apply_liveness(self._replay, config.liveness)
        if config.curve is not None:
            configure_server(self._replay, config.curve)
        return address, config.replay_endpoint.attach(self._replay)

    @property
    def num_published(self) -> int:
        """Batches sent (or, for a skipped seq, buffered) by the background thread."""
        return self._num_published

    @property
    def num_dropped(self) -> int:
        """Batches dropped: the queue was full, or (rarely) the batch could not be encoded."""
        return self._num_dropped + self._num_unencodable

    @property
    def num_replays(self) -> int:
        """Replay requests served."""
        return self._num_replays

    @property
    def next_seq(self) -> int:
        """The seq the next :meth:`publish` will assign."""
        return self._next_seq

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending; never blocks.

        Call from one thread at a time (the engine loop).

        Returns:
            ``True`` if queued, ``False`` if dropped because the queue was full.

        Raises:
            PublisherClosedError: The publisher was closed.
        """
        if self._closed or self._failed:
            raise PublisherClosedError(
                "publish() on a closed publisher (or its thread failed: see the log); "
                "create a new EventPublisher"
            )
        seq = self._next_seq
        self._next_seq = seq + 1
        if len(self._queue) >= self._config.max_queue_size:
            self._num_dropped += 1
            return False
        self._queue.append((seq, batch))
        if self._sleeping:
            self._sleeping = False
            self._wake()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread and close the sockets (idempotent)."""
        self._closed = True
        if self._released:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.error("publisher thread did not stop within %.1f s", timeout_s)
            return
        self._release()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _wake(self) -> None:
        # A full pipe already holds wake bytes: the thread will wake anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _release(self) -> None:
        self._released = True
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                self._send_queued()
                if self._replay is not None:
                    self._serve_replays()
                if self._stopping and not self._queue:
                    return
                self._sleeping = True
                if self._queue or self._stopping:
                    self._sleeping = False
                    continue
                for sock, _ in poller.poll():
                    if sock == self._wake_r:
                        os.read(self._wake_r, 4096)
                self._sleeping = False
        except Exception:
            _log.exception("publisher thread failed; no further batches will be sent")
            self._failed = True

    def _send_queued(self) -> None:
        assert self._pub is not None
        pub, topic, ring, queue = self._pub, self._config.topic, self._ring, self._queue
        skip_live_seqs, replay = self._skip_live_seqs, self._replay
        while queue:
            seq, batch = queue.popleft()
            try:
                payload = encode_batch(batch)
            except (TypeError, ValueError, msgspec.MsgspecError) as exc:
                # Its seq is never sent: subscribers see a gap that replay cannot close.
                self._num_unencodable += 1
                _log.error("dropped batch seq %d: it cannot be encoded (%s)", seq, exc)
                continue
            ring.append((seq, payload))
            if seq not in skip_live_seqs:
                send_frames(pub, (topic, pack_seq(seq), payload))
            self._num_published += 1
            if replay is not None and self._num_published % 256 == 0:
                self._serve_replays()

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = recv_frames(self._replay, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._serve_replay(frames)

    def _serve_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or frames[1] != b"":
            _log.warning('ignored a replay request of %d frames (want ["", seq8])', len(frames))
            return
        identity = frames[0]
        try:
            start = unpack_seq(frames[2])
        except FramingError as exc:
            _log.warning("ignored a replay request: %s", exc)
            return
        self._num_replays += 1
        topic = self._config.topic
        begin = bisect.bisect_left(self._ring, start, key=lambda entry: entry[0])
        try:
            for seq, payload in itertools.islice(self._ring, begin, None):
                send_frames(
                    self._replay, (identity, b"", topic, pack_seq(seq), payload), zmq.NOBLOCK
                )
            send_frames(self._replay, (identity, *_END_OF_REPLAY), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # The requester left (EHOSTUNREACH) or stopped reading past the HWM (EAGAIN):
            # it times out and resyncs; the publisher never blocks on it.
            _log.warning("abandoned a replay from seq %d: %s", start, exc.strerror)
