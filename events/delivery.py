"""StreamDelivery: hands each worker's batches to the sink in seq order, closing gaps by replay.

Per worker, batches reach the :class:`events.subscription.EventSink` strictly in seq order
and exactly once. A seq gap is closed by a vLLM-compatible replay over DEALER
(:mod:`events.replay_client`); what replay cannot close is signalled with
``on_resync_needed``, a seq at or below the last one with ``on_reset`` (a publisher
restart). A stream with a restart probe (a worker that names its publisher lifetimes) is
asked on each gap whether it restarted, since a new lifetime whose first batches were lost
shows as a jump, not a drop; it is also asked about the first batch after the connection
to the worker dropped, since a restart whose lost first batches end where the old lifetime
did looks continuous. Malformed messages are counted, logged at a limited rate and
skipped.

A replay is fetched whole before its batches are delivered: whoever asks for one inside a
sink call may release its locks for the network part (see
:meth:`events.subscriber.EventSubscriber.request_replay`). The
:class:`events.subscriber.EventSubscriber` reads the sockets and calls this with the
worker's lock held.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractAsyncContextManager

from events.errors import EventDecodeError, FramingError
from events.framing import parse_message
from events.rate_limited_log import RateLimitedLog
from events.replay_client import ReplayClient
from events.schema import decode_batch
from events.stream_state import StreamState
from events.subscription import EventSink, ReceivedBatch

__all__ = ["StreamDelivery"]

_log = logging.getLogger(__name__)


class StreamDelivery:
    """Delivers what the workers' streams carry to one sink (callers hold the worker's
    :attr:`~events.stream_state.StreamState.lock`).

    Args:
        sink: Receives batches, resets and resync signals.
        replay_client: Fetches replays from the workers' replay endpoints.
        log_interval_s: The least time between two warnings of one kind for one worker.
    """

    def __init__(self, sink: EventSink, replay_client: ReplayClient, log_interval_s: float) -> None:
        self._sink = sink
        self._replay_client = replay_client
        self._warn = RateLimitedLog(log_interval_s, _log)

    async def on_live(self, worker: StreamState, frames: list[bytes]) -> None:
        """Deliver one message of the worker's live stream, after what it shows missing."""
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

    async def _out_of_order(self, worker: StreamState, seq: int) -> bool:
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
        self, worker: StreamState, seq: int, payload: bytes, recv_ts: float, *, replayed: bool
    ) -> None:
        if worker.last_seq is None or seq > worker.last_seq:
            worker.last_seq = seq
        try:
            batch = decode_batch(payload, worker.on_unknown)
        except EventDecodeError as exc:
            # The seq was valid, so this batch's events are lost for good: a skipped
            # BlockRemoved would leave the index claiming blocks the worker no longer has.
            self._malformed(worker, exc)
            await self.resync(worker, "undecodable_batch")
            return
        counters = worker.counters
        counters.num_batches += 1
        counters.num_replayed += replayed
        await self._sink.on_batch(
            ReceivedBatch(worker.stream.worker_id, seq, batch, payload, recv_ts, replayed)
        )

    async def _restarted(self, worker: StreamState) -> bool:
        worker.probe_next = False
        probe = worker.stream.restart_probe
        return probe is not None and await probe()

    async def _reset(self, worker: StreamState, seq: int, why: str) -> None:
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

    async def _gap(self, worker: StreamState, first_missing: int, seq: int) -> None:
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
        await self.replay(worker, first_missing, through=seq - 1, redeliver=False)

    async def resync(self, worker: StreamState, reason: str) -> None:
        """Count and signal that the worker's events were lost for good (``reason``)."""
        worker.counters.resyncs[reason] += 1
        self._warn.warning(
            (worker.stream.worker_id, f"resync:{reason}"),
            "worker %s: events lost for good (%s); its state needs a resync",
            worker.stream.worker_id,
            reason,
        )
        await self._sink.on_resync_needed(worker.stream.worker_id, reason)

    def _malformed(self, worker: StreamState, exc: EventDecodeError) -> None:
        worker.counters.malformed[exc.reason] += 1
        self._warn.warning(
            (worker.stream.worker_id, f"malformed:{exc.reason}"),
            "worker %s: skipped a malformed message: %s",
            worker.stream.worker_id,
            exc,
        )

    def unknown_event(self, worker: StreamState, what: str) -> None:
        """Count an event of a type this version does not know (``decode_batch``'s hook)."""
        worker.counters.malformed["unknown_tag"] += 1
        self._warn.warning(
            (worker.stream.worker_id, "malformed:unknown_tag"),
            "worker %s: skipped an event of a type this version does not know (%s); "
            "the rest of its batch was applied",
            worker.stream.worker_id,
            what,
        )

    async def redeliver(
        self,
        worker: StreamState,
        from_seq: int,
        release: AbstractAsyncContextManager[object] | None,
    ) -> bool:
        """Deliver again the worker's batches from ``from_seq`` (lowered to the next
        undelivered seq) through the last delivered (see
        :meth:`events.subscriber.EventSubscriber.request_replay`)."""
        last = worker.last_seq
        if last is None:
            through = from_seq - 1
        else:
            from_seq = min(from_seq, last + 1)
            through = last
        return await self.replay(worker, from_seq, through=through, redeliver=True, release=release)

    async def replay(
        self,
        worker: StreamState,
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
            await self.resync(worker, "replay_nested")
            return False
        if stream.replay_endpoint is None:
            await self.resync(worker, "no_replay_endpoint")
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
            await self.resync(worker, result.failure)
            return False
        _log.info("worker %s: replayed from seq %d", stream.worker_id, from_seq)
        return True
