"""The subscriber's contracts: what a worker's stream is, what the sink is told, what is counted.

:class:`WorkerStream` says where a worker publishes, :class:`SubscriberConfig` how the
subscriber reads it; the subscriber hands each batch to an :class:`EventSink` as a
:class:`ReceivedBatch` and counts what happened per worker in :class:`WorkerCounters`.
No I/O here: :mod:`events.subscriber` is the ZeroMQ side.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from events.curve import CurveClientConfig
from events.errors import EventsError
from events.identity import WorkerId
from events.liveness import SocketLiveness
from events.schema import KVEventBatch

__all__ = [
    "EventSink",
    "ReceivedBatch",
    "SubscriberConfig",
    "SubscriberError",
    "WorkerCounters",
    "WorkerStream",
]


class SubscriberError(EventsError, ValueError):
    """A worker id is unknown or already subscribed."""


class ReceivedBatch(msgspec.Struct, frozen=True, gc=False):
    """One batch as delivered to the sink (a Struct: built per batch, it must be cheap).

    Attributes:
        worker_id: The worker that published it.
        seq: Its sequence number in that worker's current publisher lifetime.
        batch: The decoded events.
        payload: The raw msgpack payload, as received (for recorders).
        recv_ts: Wall-clock time in seconds when it was received.
        replayed: ``True`` if it came through replay rather than the live stream.
    """

    worker_id: WorkerId
    seq: int
    batch: KVEventBatch
    payload: bytes
    recv_ts: float
    replayed: bool


class EventSink(Protocol):
    """Consumer of a subscriber's deliveries; all calls for one worker are sequential."""

    async def on_batch(self, received: ReceivedBatch) -> None:
        """Apply one batch (per worker: in seq order, exactly once)."""

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
        """The worker's publisher restarted; ``seq`` is the first seen of its new lifetime.

        ``seq`` is at or below the last one seen, or above it and the stream's restart
        probe said so. The new lifetime's batches before ``seq`` follow (replayed), or
        ``on_resync_needed`` if they cannot.
        """

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
        """Batches of the worker were lost for good; its state must be rebuilt.

        ``reason`` is one of ``"no_replay_endpoint"``, ``"replay_timeout"`` (the replay
        endpoint stayed silent), ``"replay_deadline"`` (the replay did not end within the
        overall deadline: replies trickled), ``"replay_unreachable"`` (the replay address
        cannot be connected to), ``"replay_buffer_overrun"`` (the first batch asked for
        is not buffered: it left the ring buffer, or the publisher dropped it on a full
        queue), ``"replay_hole"`` / ``"replay_short"`` / ``"replay_empty"`` (the replay
        skipped or ended before batches it had to cover: the publisher restarted
        meanwhile), ``"replay_nested"`` (a replay was asked for during a replay) and
        ``"reader_restarted"`` (the worker's reader failed and was restarted: the batch
        it was handling may be lost).
        """


@dataclass(frozen=True, slots=True)
class WorkerStream:
    """Where one worker publishes; the subscriber always connects to these addresses.

    Attributes:
        worker_id: The worker's identity (unique per subscriber).
        endpoint: The worker's PUB address, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: The worker's replay ROUTER address; ``None``: gaps cannot be
            replayed and always resync.
        topic: Topic prefix to subscribe to (``b""`` = everything).
        curve: CURVE client settings when the worker's sockets are CURVE servers.
        restart_probe: Awaited on a live seq gap, before replaying it, and on the first
            live batch after the connection to the worker dropped: ``True`` means the
            publisher restarted since the last batch delivered (a new lifetime whose first
            batches were lost), and the batch is handled as a restart (``on_reset``, then
            the new lifetime replayed from seq 0). It must not raise; it answers ``False``
            when unsure. ``None``: only a seq drop is a restart.
    """

    worker_id: WorkerId
    endpoint: str
    replay_endpoint: str | None = None
    topic: bytes = b""
    curve: CurveClientConfig | None = None
    restart_probe: Callable[[], Awaitable[bool]] | None = None


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """Settings of an :class:`EventSubscriber`.

    Attributes:
        replay_timeout_s: Longest silence accepted from a replay endpoint before the
            replay is abandoned and the worker resynced.
        replay_deadline_s: Longest a whole replay may take, however steadily its replies
            come (a replay of a full buffer of 10,000 batches takes well under a second
            on loopback); past it the replay is abandoned and the worker resynced.
        hwm: Receive high-water mark of each SUB socket, in messages.
        max_drain: Messages handled from one worker before yielding to other tasks.
        log_interval_s: Repeats of one warning per (worker, reason) are logged at most
            this often, with the number suppressed.
        on_reader_failure: What an unexpected failure of a worker's reader task (a sink
            error, say) does: ``"restart"`` it after a backoff (logged and counted; for a
            service that must keep reading), or ``"stop"`` the subscriber and re-raise
            it from :meth:`events.subscriber.EventSubscriber.run` (for a tool).
        restart_backoff_s: The first wait before a failed task restarts; it doubles with
            each failure that follows quickly, up to ``restart_backoff_max_s``.
        restart_backoff_max_s: The longest wait before a failed task restarts.
        liveness: Heartbeats and TCP keepalive on the SUB and replay sockets, so a
            connection whose publisher side is gone is dropped and made again instead of
            staying silently open (see :mod:`events.liveness`).
        max_sockets: ZeroMQ sockets the subscriber's context may open (libzmq's default
            is 1,023: 341 workers). A worker takes one SUB socket, two more for its
            connection monitor (disconnects, failed handshakes) and one DEALER while it
            replays: at most 4, so the default leaves room for 4,000 workers.
    """

    replay_timeout_s: float = 5.0
    replay_deadline_s: float = 30.0
    hwm: int = 100_000
    max_drain: int = 256
    log_interval_s: float = 10.0
    on_reader_failure: Literal["restart", "stop"] = "restart"
    restart_backoff_s: float = 0.1
    restart_backoff_max_s: float = 5.0
    liveness: SocketLiveness = field(default_factory=SocketLiveness)
    max_sockets: int = 16_384


@dataclass
class WorkerCounters:
    """What happened on one worker's stream.

    Attributes:
        num_batches: Batches delivered to the sink (live and replayed).
        num_replayed: Of those, batches delivered through replay.
        num_gaps: Seq gaps seen on the live stream.
        num_missed: Seqs missing in those gaps (before any replay).
        num_replays: Replay requests made.
        num_resets: Publisher restarts seen.
        num_duplicates: Batches received again and skipped (replay overlap).
        num_handshake_failures: Failed ZeroMQ handshakes (wrong CURVE keys, not allowed).
        num_resubscribes: Times the connection to the worker was dropped and made again
            on request (:meth:`events.subscriber.EventSubscriber.resubscribe`).
        malformed: Malformed messages skipped, by reason.
        resyncs: Resync signals, by reason.
        task_restarts: Restarts of the worker's tasks after a failure, by task
            (``reader``, ``monitor``).
    """

    num_batches: int = 0
    num_replayed: int = 0
    num_gaps: int = 0
    num_missed: int = 0
    num_replays: int = 0
    num_resets: int = 0
    num_duplicates: int = 0
    num_handshake_failures: int = 0
    num_resubscribes: int = 0
    malformed: collections.Counter[str] = field(default_factory=collections.Counter)
    resyncs: collections.Counter[str] = field(default_factory=collections.Counter)
    task_restarts: collections.Counter[str] = field(default_factory=collections.Counter)

    def snapshot(self) -> WorkerCounters:
        """An independent copy."""
        return dataclasses.replace(
            self,
            malformed=collections.Counter(self.malformed),
            resyncs=collections.Counter(self.resyncs),
            task_restarts=collections.Counter(self.task_restarts),
        )
