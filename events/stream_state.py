"""StreamState: what an :class:`events.subscriber.EventSubscriber` holds of one worker's stream.

Its sockets and tasks, the lock that serialises the stream's deliveries, how far the
stream is delivered and what is counted of it. The subscriber (which reads the sockets)
and its :class:`events.delivery.StreamDelivery` (which hands the batches to the sink)
share it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from events.subscription import WorkerCounters, WorkerStream

__all__ = ["StreamState"]


@dataclass(eq=False)
class StreamState:
    """The subscriber's state of one worker's stream.

    Attributes:
        stream: Where the worker publishes.
        sock: The SUB socket the worker's stream is read from.
        drain: The same socket, shadowed for non-blocking drains.
        monitor: The SUB socket's connection events.
    """

    stream: WorkerStream
    sock: zmq.asyncio.Socket
    drain: zmq.Socket[bytes]
    monitor: zmq.asyncio.Socket
    # NOTE: decode_batch's on_unknown for this worker, bound once rather than per batch.
    on_unknown: Callable[[str], None] = field(init=False)
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # NOTE: last_seq is the highest seq delivered (-1 after a reset: the new lifetime
    # starts at 0); live_seq the highest seen on the live stream (None before the first).
    # While the live stream lags behind what a replay delivered, a live seq in
    # (live_seq, last_seq] is a duplicate; one at or below live_seq is a restart.
    last_seq: int | None = None
    live_seq: int | None = None
    replaying: bool = False
    # NOTE: set when the connection to the worker dropped (it may have restarted): the
    # next live batch asks the stream's restart probe first, whatever its seq.
    probe_next: bool = False
    # NOTE: dropped is set when the connection to the worker dropped; reconnected when it
    # was made again since (cleared by take_reconnected).
    dropped: bool = False
    reconnected: bool = False
    # NOTE: a task other than the reader that holds `lock` while it delivers (catch_up):
    # the sink's replay requests from it are served in place, as the reader's are.
    holder: asyncio.Task[object] | None = None
    # NOTE: time.monotonic() of the last live message received, or of the subscription
    # or the last resubscribe when later (what idle_s measures from).
    heard_s: float = field(default_factory=time.monotonic)
