"""EventSubscriber: subscribes to many workers' KV event streams and reads each on its own task.

One asyncio task per worker reads that worker's SUB socket, so one worker's replay or slow
sink never stalls another worker; a second one watches the socket's connection (drops,
reconnects, failed CURVE handshakes). What is read is handed to the
:class:`events.delivery.StreamDelivery`, which delivers it to the :class:`EventSink` in seq
order, exactly once, with gap, replay and restart recovery (see there); the subscriber's
state of each worker is an :class:`events.stream_state.StreamState`.

Each worker's reader task is supervised: an unexpected failure is logged with the worker
id, counted, and the reader restarts after a backoff (doubling up to a cap), first asking
the sink for a resync (the batch in flight may be lost).

Connections are kept honest by heartbeats and TCP keepalive (:mod:`events.liveness`), and
a caller that watches for quiet streams (the router's idle watchdog) gets the hooks it
needs: how long a stream has been quiet (:meth:`EventSubscriber.idle_s`), whether its
connection was made again (:meth:`EventSubscriber.take_reconnected`), a catch-up replay
from a seq (:meth:`EventSubscriber.catch_up`) and a new connection
(:meth:`EventSubscriber.resubscribe`).

The stream, sink and counter types live in :mod:`events.subscription` and are re-exported
here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.cancellation import cancel_and_wait
from events.curve import configure_client
from events.delivery import StreamDelivery
from events.framing import recv_frames
from events.identity import WorkerId
from events.liveness import apply_liveness
from events.rate_limited_log import RateLimitedLog
from events.replay_client import ReplayClient
from events.stream_state import StreamState
from events.subscription import (
    EventSink,
    ReceivedBatch,
    SubscriberConfig,
    SubscriberError,
    WorkerCounters,
    WorkerStream,
)

__all__ = [
    "EventSink",
    "EventSubscriber",
    "ReceivedBatch",
    "SubscriberConfig",
    "SubscriberError",
    "WorkerCounters",
    "WorkerStream",
]

_log = logging.getLogger(__name__)

_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITORED: Final = _HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_monitor_ids = itertools.count()


class EventSubscriber:
    """Subscribes to the KV event streams of many workers and feeds one sink.

    The first message from a worker is accepted whatever its seq (the subscriber may join
    a stream late; batches before it are not requested). Use :meth:`request_replay` to ask
    for earlier ones.

    Args:
        sink: Receives batches, resets and resync signals.
        config: Timeouts and limits.
    """

    def __init__(self, sink: EventSink, config: SubscriberConfig | None = None) -> None:
        self._config = config or SubscriberConfig()
        self._context = zmq.asyncio.Context()
        # Set before the first socket: libzmq's default (1,023) would stop at a few
        # hundred workers.
        limit = self._context.get(zmq.SOCKET_LIMIT)
        self._context.set(zmq.MAX_SOCKETS, min(self._config.max_sockets, limit))
        self._workers: dict[WorkerId, StreamState] = {}
        self._stopped = asyncio.Event()
        self._failure: BaseException | None = None
        self._warn = RateLimitedLog(self._config.log_interval_s, _log)
        replay_client = ReplayClient(
            self._context,
            self._config.replay_timeout_s,
            self._config.replay_deadline_s,
            self._config.liveness,
        )
        self._delivery = StreamDelivery(sink, replay_client, self._config.log_interval_s)

    @property
    def worker_ids(self) -> list[WorkerId]:
        """The subscribed workers, in subscription order."""
        return list(self._workers)

    def last_seq(self, worker_id: WorkerId) -> int | None:
        """The highest seq delivered for ``worker_id`` (``None`` before the first)."""
        return self._worker(worker_id).last_seq

    def counters(self, worker_id: WorkerId) -> WorkerCounters:
        """A snapshot of ``worker_id``'s counters."""
        return self._worker(worker_id).counters.snapshot()

    def idle_s(self, worker_id: WorkerId) -> float:
        """Seconds since ``worker_id``'s live stream last delivered a message (or since it
        was subscribed or resubscribed, when later)."""
        return time.monotonic() - self._worker(worker_id).heard_s

    def take_reconnected(self, worker_id: WorkerId) -> bool:
        """Whether the connection to the worker dropped and was made again since the last
        call: what it published in between was lost, and shows only at its next batch
        (or at a position check)."""
        worker = self._worker(worker_id)
        reconnected, worker.reconnected = worker.reconnected, False
        return reconnected

    def resubscribe(self, worker_id: WorkerId) -> None:
        """Drop the connection to the worker's events endpoint and make it again.

        For a stream found behind its publisher while its connection looks open (the
        publisher's side of it is gone). What was queued on the old connection is lost;
        the next live batch shows the loss as a gap, replayed as any other. The first
        batch after it asks the stream's restart probe (as after any reconnect).

        Raises:
            SubscriberError: The worker is not subscribed.
        """
        worker = self._worker(worker_id)
        endpoint = worker.stream.endpoint
        with contextlib.suppress(zmq.ZMQError):  # not connected now: connect anyway
            worker.sock.disconnect(endpoint)
        worker.sock.connect(endpoint)
        worker.probe_next = worker.stream.restart_probe is not None
        worker.heard_s = time.monotonic()
        worker.counters.num_resubscribes += 1
        _log.info("worker %s: resubscribed to %s", worker_id, endpoint)

    async def catch_up(self, worker_id: WorkerId, from_seq: int) -> int | None:
        """Ask the worker's replay endpoint for what it published from ``from_seq`` on and
        deliver the batches not delivered yet (as a gap's replay would).

        A publisher that sent nothing since answers with the end of replay alone, so this
        checks, at the cost of one request, whether a quiet stream missed batches.
        Serialised with the worker's live stream. The sink may ask for a replay while the
        batches are delivered (:meth:`request_replay`), as from a live batch.

        Returns:
            The number of batches delivered; ``None`` when the replay failed (then
            ``on_resync_needed`` was signalled) or there is no replay endpoint.

        Raises:
            SubscriberError: The worker is not subscribed.
        """
        worker = self._worker(worker_id)
        if worker.stream.replay_endpoint is None:
            return None
        async with worker.lock:
            worker.holder = asyncio.current_task()
            try:
                before = worker.counters.num_batches
                done = await self._delivery.replay(
                    worker, from_seq, through=from_seq - 1, redeliver=False, nested_ok=True
                )
            finally:
                worker.holder = None
            return worker.counters.num_batches - before if done else None

    async def add_worker(self, stream: WorkerStream) -> None:
        """Subscribe to a worker's stream and start reading it.

        Raises:
            SubscriberError: The worker id is already subscribed, or the socket cannot
                be set up (e.g. an endpoint ZeroMQ cannot connect to); nothing is left
                open then.
        """
        if stream.worker_id in self._workers:
            raise SubscriberError(f"worker {stream.worker_id!r} is already subscribed")
        try:
            sock = self._context.socket(zmq.SUB)
        except zmq.ZMQError as exc:  # out of sockets or file descriptors
            raise self._out_of_sockets(stream, exc) from None
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.linger = 0
            sock.rcvhwm = self._config.hwm
            apply_liveness(sock, self._config.liveness)
            if stream.curve is not None:
                configure_client(sock, stream.curve)
            monitor = sock.get_monitor_socket(
                _MONITORED, addr=f"inproc://kvroute-monitor-{next(_monitor_ids)}"
            )
            sock.subscribe(stream.topic)
            sock.connect(stream.endpoint)
        except zmq.ZMQError as exc:
            # A socket left open would block the context's term() at close for ever.
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            if exc.errno == errno.EMFILE:  # the monitor's sockets did not fit
                raise self._out_of_sockets(stream, exc) from None
            raise SubscriberError(
                f"worker {stream.worker_id!r}: cannot subscribe to its events endpoint "
                f"{stream.endpoint!r} ({zmq.strerror(exc.errno or 0)}); expected e.g. "
                "tcp://HOST:PORT"
            ) from None
        worker = StreamState(stream, sock, zmq.Socket.shadow(sock.underlying), monitor)
        worker.on_unknown = functools.partial(self._delivery.unknown_event, worker)
        self._workers[stream.worker_id] = worker
        for name, body in (("reader", self._read), ("monitor", self._watch_connection)):
            task = asyncio.create_task(
                self._supervised(worker, name, body), name=f"kv-events-{name}[{stream.worker_id}]"
            )
            task.add_done_callback(self._on_task_done)
            worker.tasks.append(task)

    def _out_of_sockets(self, stream: WorkerStream, exc: zmq.ZMQError) -> SubscriberError:
        return SubscriberError(
            f"worker {stream.worker_id!r}: cannot open a socket for its events "
            f"({zmq.strerror(exc.errno or 0)}; {len(self._workers)} workers subscribed, "
            f"at most {self._config.max_sockets} sockets): raise the process's file "
            "descriptor limit (ulimit -n) or spread the workers over more routers"
        )

    async def remove_worker(self, worker_id: WorkerId) -> None:
        """Stop reading a worker's stream and forget its state and counters.

        Not from inside the sink's calls for that worker (its reader would cancel itself).

        Raises:
            SubscriberError: The worker is not subscribed, or the call comes from its reader.
        """
        worker = self._worker(worker_id)
        if asyncio.current_task() in worker.tasks:
            raise SubscriberError(
                f"remove_worker({worker_id!r}) from inside that worker's sink call; "
                "call it from another task"
            )
        del self._workers[worker_id]
        await cancel_and_wait(worker.tasks)
        worker.sock.disable_monitor()
        worker.monitor.close(linger=0)
        worker.sock.close(linger=0)

    async def request_replay(
        self,
        worker_id: WorkerId,
        from_seq: int,
        *,
        release: AbstractAsyncContextManager[object] | None = None,
    ) -> bool:
        """Deliver again the worker's batches from ``from_seq`` on, then resume live.

        Batches already delivered are delivered again (``replayed=True``), in order; the
        caller asked for them and must be ready to apply them. Live batches of that worker
        wait until the replay ends. May be awaited from inside the sink's ``on_batch``.
        The replay is fetched whole (bounded by the replay timeout and deadline) inside
        ``release``, then delivered: a sink that asks from inside ``on_batch`` passes a
        context that releases its locks there, so no lock is held across the network wait.

        A ``from_seq`` above the next undelivered seq is lowered to it: a replay never
        skips batches.

        Returns:
            ``True`` if every batch from ``from_seq`` through the last delivered one was
            replayed; ``False`` if not, in which case ``on_resync_needed`` was signalled.

        Raises:
            SubscriberError: The worker is not subscribed.
        """
        worker = self._worker(worker_id)
        task = asyncio.current_task()
        if task in worker.tasks or (task is not None and task is worker.holder):
            return await self._delivery.redeliver(worker, from_seq, release)
        async with worker.lock:
            return await self._delivery.redeliver(worker, from_seq, release)

    async def run(self) -> None:
        """Wait until :meth:`close`; with ``on_reader_failure="stop"``, re-raises the first
        failure of a reader (a sink error)."""
        await self._stopped.wait()
        if self._failure is not None:
            await self.close()
            raise self._failure

    async def close(self) -> None:
        """Unsubscribe from every worker and release the sockets (idempotent)."""
        for worker_id in list(self._workers):
            await self.remove_worker(worker_id)
        if not self._context.closed:
            self._context.term()
        self._stopped.set()

    async def __aenter__(self) -> EventSubscriber:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _worker(self, worker_id: WorkerId) -> StreamState:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise SubscriberError(f"worker {worker_id!r} is not subscribed") from None

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        _log.error("event reader %s failed", task.get_name(), exc_info=task.exception())
        if self._failure is None:
            self._failure = task.exception()
        self._stopped.set()

    async def _supervised(
        self, worker: StreamState, name: str, body: Callable[[StreamState, bool], Awaitable[None]]
    ) -> None:
        """Run one of the worker's tasks; restart it after a failure (see the module
        docstring), unless the config says to stop (then the failure ends the task)."""
        config, wid = self._config, worker.stream.worker_id
        backoff_s, restarted = config.restart_backoff_s, False
        while True:
            started = time.monotonic()
            try:
                await body(worker, restarted)
                return
            except Exception as exc:
                if config.on_reader_failure == "stop":
                    raise
                if time.monotonic() - started > config.restart_backoff_max_s:
                    backoff_s = config.restart_backoff_s  # it had recovered: start over
                worker.counters.task_restarts[name] += 1
                _log.error(
                    "worker %s: its %s task failed (%r); restarting it in %.1f s",
                    wid, name, exc, backoff_s, exc_info=exc,
                )  # fmt: skip
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, config.restart_backoff_max_s)
            restarted = True

    async def _read(self, worker: StreamState, restarted: bool) -> None:
        if restarted:
            # The batch in flight when the reader failed may never have reached the sink.
            async with worker.lock:
                await self._delivery.resync(worker, "reader_restarted")
        sock, drain, max_drain = worker.sock, worker.drain, self._config.max_drain
        while True:
            frames: list[bytes] = await sock.recv_multipart()
            worker.heard_s = time.monotonic()
            async with worker.lock:
                await self._delivery.on_live(worker, frames)
                # Drain what is already queued without a future per message.
                for _ in range(max_drain):
                    try:
                        frames = recv_frames(drain, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._delivery.on_live(worker, frames)

    async def _watch_connection(self, worker: StreamState, restarted: bool) -> None:
        stream = worker.stream
        while True:
            event = parse_monitor_message(await worker.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # The worker may come back as a new publisher lifetime whose first batches
                # are lost; seqs cannot always tell (see StreamDelivery.on_live).
                worker.probe_next = stream.restart_probe is not None
                worker.dropped = True
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                worker.reconnected, worker.dropped = worker.dropped, False
                continue
            worker.counters.num_handshake_failures += 1
            self._warn.warning(
                (stream.worker_id, "handshake"),
                "worker %s: handshake with %s failed (event %s); check its CURVE keys "
                "and this subscriber's place on its allow-list",
                stream.worker_id,
                stream.endpoint,
                event["event"],
            )
