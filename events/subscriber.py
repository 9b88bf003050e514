"""EventSubscriber: consumes many workers' KV event streams with gap, replay and restart recovery.

One asyncio task per worker reads that worker's SUB socket, so one worker's replay or slow
sink never stalls another worker. Per worker, batches reach the :class:`EventSink` strictly
in seq order and exactly once. A seq gap is closed by a vLLM-compatible replay over DEALER
(:mod:`events.replay_client`); what replay cannot close is signalled with
``on_resync_needed``, a seq at or below the last one with ``on_reset`` (a publisher
restart). A stream with a restart probe (a worker that names its publisher lifetimes) is
asked on each gap whether it restarted, since a new lifetime whose first batches were lost
shows as a jump, not a drop; it is also asked about the first batch after the connection
to the worker dropped, since a restart whose lost first batches end where the old lifetime
did looks continuous. Malformed messages are counted, logged at a limited rate and
skipped.

A replay is fetched whole before its batches are delivered: whoever asks for one inside a
sink call may release its locks for the network part (see :meth:`EventSubscriber.request_replay`).
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
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.curve import configure_client
from events.errors import EventDecodeError, FramingError
from events.framing import parse_message, recv_frames
from events.identity import WorkerId
from events.liveness import apply_liveness
from events.rate_limited_log import RateLimitedLog
from events.replay_client import ReplayClient
from events.schema import decode_batch
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


@dataclass(eq=False)
class _Worker:
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
        self._sink = sink
        self._config = config or SubscriberConfig()
        self._context = zmq.asyncio.Context()
        # Set before the first socket: libzmq's default (1,023) would stop at a few
        # hundred workers.
        limit = self._context.get(zmq.SOCKET_LIMIT)
        self._context.set(zmq.MAX_SOCKETS, min(self._config.max_sockets, limit))
        self._workers: dict[WorkerId, _Worker] = {}
        self._stopped = asyncio.Event()
        self._failure: BaseException | None = None
        self._warn = RateLimitedLog(self._config.log_interval_s, _log)
        self._replay_client = ReplayClient(
            self._context,
            self._config.replay_timeout_s,
            self._config.replay_deadline_s,
            self._config.liveness,
        )

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
                done = await self._replay(
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
        worker = _Worker(stream, sock, zmq.Socket.shadow(sock.underlying), monitor)
        worker.on_unknown = functools.partial(self._unknown_event, worker)
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
        for task in worker.tasks:
            task.cancel()
        await asyncio.gather(*worker.tasks, return_exceptions=True)
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
            return await self._redeliver(worker, from_seq, release)
        async with worker.lock:
            return await self._redeliver(worker, from_seq, release)

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

    def _worker(self, worker_id: WorkerId) -> _Worker:
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
        self, worker: _Worker, name: str, body: Callable[[_Worker, bool], Awaitable[None]]
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

    async def _read(self, worker: _Worker, restarted: bool) -> None:
        if restarted:
            # The batch in flight when the reader failed may never have reached the sink.
            async with worker.lock:
                await self._resync(worker, "reader_restarted")
        sock, drain, max_drain = worker.sock, worker.drain, self._config.max_drain
        while True:
            frames: list[bytes] = await sock.recv_multipart()
            worker.heard_s = time.monotonic()
            async with worker.lock:
                await self._on_live(worker, frames)
                # Drain what is already queued without a future per message.
                for _ in range(max_drain):
                    try:
                        frames = recv_frames(drain, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._on_live(worker, frames)

    async def _watch_connection(self, worker: _Worker, restarted: bool) -> None:
        stream = worker.stream
        while True:
            event = parse_monitor_message(await worker.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # The worker may come back as a new publisher lifetime whose first batches
                # are lost; seqs cannot always tell (see _on_live).
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

    async def _on_live(self, worker: _Worker, frames: list[bytes]) -> None:
        recv_ts = time.time()
        try:
            _, seq, payload = parse_message(frames)
        except FramingError as exc:
            self._malformed(worker, exc)
            return
        last = worker.last_seq
        if (
            last is not None
            and (seq != last + 1 or worker.probe_next)
            and not await self._out_of_order(worker, seq)
        ):
            return
        worker.live_seq = seq
        await self._deliver(worker, seq, payload, recv_ts, replayed=False)

    async def _out_of_order(self, worker: _Worker, seq: int) -> bool:
        """Handle a live ``seq`` other than the next one, or the first after the connection
        dropped; ``True``: deliver it now.

        A duplicate is counted, a restart reset, and a gap before ``seq`` replayed.
        """
        last = worker.last_seq
        assert last is not None
        if seq <= last:
            if worker.live_seq is None or seq > worker.live_seq:
                worker.live_seq = seq
                worker.counters.num_duplicates += 1
                return False
            await self._reset(worker, seq, "seq went back")
            last = worker.last_seq = -1
        elif await self._restarted(worker):
            await self._reset(worker, seq, "restart probe: new publisher lifetime")
            last = worker.last_seq = -1
        worker.live_seq = seq
        if seq > last + 1:
            await self._gap(worker, last + 1, seq)
            delivered = worker.last_seq
            assert delivered is not None
            if seq <= delivered:  # the replay delivered it
                worker.counters.num_duplicates += 1
                return False
        return True

    async def _deliver(
        self, worker: _Worker, seq: int, payload: bytes, recv_ts: float, *, replayed: bool
    ) -> None:
        if worker.last_seq is None or seq > worker.last_seq:
            worker.last_seq = seq
        try:
            batch = decode_batch(payload, worker.on_unknown)
        except EventDecodeError as exc:
            # The seq was valid, so this batch's events are lost for good: a skipped
            # BlockRemoved would leave the index claiming blocks the worker no longer has.
            self._malformed(worker, exc)
            await self._resync(worker, "undecodable_batch")
            return
        counters = worker.counters
        counters.num_batches += 1
        counters.num_replayed += replayed
        await self._sink.on_batch(
            ReceivedBatch(worker.stream.worker_id, seq, batch, payload, recv_ts, replayed)
        )

    async def _restarted(self, worker: _Worker) -> bool:
        worker.probe_next = False
        probe = worker.stream.restart_probe
        return probe is not None and await probe()

    async def _reset(self, worker: _Worker, seq: int, why: str) -> None:
        worker.probe_next = False  # this is the restart the probe would have found
        worker.counters.num_resets += 1
        self._warn.warning(
            (worker.stream.worker_id, "reset"),
            "worker %s: seq %d after %d: publisher restarted (%s), resetting its stream",
            worker.stream.worker_id,
            seq,
            worker.last_seq,
            why,
        )
        await self._sink.on_reset(worker.stream.worker_id, seq)

    async def _gap(self, worker: _Worker, first_missing: int, seq: int) -> None:
        counters = worker.counters
        counters.num_gaps += 1
        counters.num_missed += seq - first_missing
        self._warn.warning(
            (worker.stream.worker_id, "gap"),
            "worker %s: gap of %d batches before seq %d; replaying from %d",
            worker.stream.worker_id,
            seq - first_missing,
            seq,
            first_missing,
        )
        await self._replay(worker, first_missing, through=seq - 1, redeliver=False)

    async def _resync(self, worker: _Worker, reason: str) -> None:
        worker.counters.resyncs[reason] += 1
        self._warn.warning(
            (worker.stream.worker_id, f"resync:{reason}"),
            "worker %s: events lost for good (%s); its state needs a resync",
            worker.stream.worker_id,
            reason,
        )
        await self._sink.on_resync_needed(worker.stream.worker_id, reason)

    def _malformed(self, worker: _Worker, exc: EventDecodeError) -> None:
        worker.counters.malformed[exc.reason] += 1
        self._warn.warning(
            (worker.stream.worker_id, f"malformed:{exc.reason}"),
            "worker %s: skipped a malformed message: %s",
            worker.stream.worker_id,
            exc,
        )

    def _unknown_event(self, worker: _Worker, what: str) -> None:
        worker.counters.malformed["unknown_tag"] += 1
        self._warn.warning(
            (worker.stream.worker_id, "malformed:unknown_tag"),
            "worker %s: skipped an event of a type this version does not know (%s); "
            "the rest of its batch was applied",
            worker.stream.worker_id,
            what,
        )

    async def _redeliver(
        self,
        worker: _Worker,
        from_seq: int,
        release: AbstractAsyncContextManager[object] | None,
    ) -> bool:
        last = worker.last_seq
        if last is None:
            through = from_seq - 1
        else:
            from_seq = min(from_seq, last + 1)
            through = last
        return await self._replay(
            worker, from_seq, through=through, redeliver=True, release=release
        )

    async def _replay(
        self,
        worker: _Worker,
        from_seq: int,
        *,
        through: int,
        redeliver: bool,
        release: AbstractAsyncContextManager[object] | None = None,
        nested_ok: bool = False,
    ) -> bool:
        """Replay from ``from_seq``; it must reach at least ``through`` to succeed.

        The replies are fetched inside ``release`` (the caller's locks released), then
        delivered in order. With ``nested_ok`` the sink may ask for a replay of its own
        while they are delivered (the rest of them then skipped as duplicates where that
        one delivered them); else that is a ``replay_nested`` resync.
        """
        stream = worker.stream
        if worker.replaying:
            await self._resync(worker, "replay_nested")
            return False
        if stream.replay_endpoint is None:
            await self._resync(worker, "no_replay_endpoint")
            return False
        worker.replaying = True
        worker.counters.num_replays += 1
        try:
            async with release or contextlib.nullcontext():
                result = await self._replay_client.fetch(
                    stream.replay_endpoint, stream.curve, from_seq, through=through
                )
            for exc in result.malformed:
                self._malformed(worker, exc)
            worker.replaying = not nested_ok
            for seq, payload in result.batches:
                if redeliver or worker.last_seq is None or seq > worker.last_seq:
                    await self._deliver(worker, seq, payload, time.time(), replayed=True)
                else:
                    worker.counters.num_duplicates += 1
        finally:
            worker.replaying = False
        if result.failure is not None:
            await self._resync(worker, result.failure)
            return False
        _log.info("worker %s: replayed from seq %d", stream.worker_id, from_seq)
        return True
