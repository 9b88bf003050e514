"""Replay client: asks a worker's replay endpoint for its batches from a seq and checks the reply.

vLLM's replay protocol over DEALER/ROUTER: the request is ``[b"", seq]``; the worker answers
``[b"", topic, seq, payload]`` per buffered batch from that seq on, then the same with the
end marker (:data:`events.framing.END_OF_REPLAY_SEQ`) as seq. A reply out of order means
the batches asked for are no longer buffered; silence means the endpoint is gone.

A replay is bounded twice: by the silence accepted between two replies and by an overall
deadline, so an endpoint that trickles replies (malformed ones, say) cannot hold a
replay open forever. The replies are collected first and handed back whole: the caller
applies them once the network part is over (and can hold its locks only for that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from events.curve import CurveClientConfig, configure_client
from events.errors import EventDecodeError, FramingError
from events.framing import END_OF_REPLAY_SEQ, pack_seq, recv_frames, unpack_seq
from events.liveness import SocketLiveness, apply_liveness

__all__ = ["ReplayClient", "ReplayResult"]


@dataclass(slots=True)
class ReplayResult:
    """What one replay brought back.

    Attributes:
        batches: The replayed ``(seq, payload)`` pairs, in seq order with no hole (also
            when the replay failed: what came before the failure).
        malformed: The replies that did not parse (skipped).
        failure: ``None`` on success, else why the replay failed: ``"replay_timeout"``,
            ``"replay_deadline"``, ``"replay_unreachable"``, ``"replay_buffer_overrun"``,
            ``"replay_hole"``, ``"replay_short"`` or ``"replay_empty"`` (see
            :meth:`events.subscription.EventSink.on_resync_needed`).
    """

    batches: list[tuple[int, bytes]] = field(default_factory=list)
    malformed: list[EventDecodeError] = field(default_factory=list)
    failure: str | None = None


class ReplayClient:
    """Makes replay requests, each over a DEALER socket that lives for that request only.

    Args:
        context: The ZeroMQ context the sockets are made in (owned by the caller).
        timeout_s: Longest silence accepted from a replay endpoint before giving up.
        deadline_s: Longest a whole replay may take, however steadily replies come.
        liveness: Heartbeats and TCP keepalive of the request's connection.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        timeout_s: float,
        deadline_s: float,
        liveness: SocketLiveness | None = None,
    ) -> None:
        self._context = context
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._liveness = liveness or SocketLiveness()

    async def fetch(
        self, endpoint: str, curve: CurveClientConfig | None, from_seq: int, *, through: int
    ) -> ReplayResult:
        """Replay from ``from_seq``; the replies must reach at least ``through`` to succeed.

        Args:
            endpoint: The worker's replay ROUTER address.
            curve: CURVE client settings when that socket is a CURVE server.
            from_seq: The first seq asked for.
            through: The last seq the replay must cover (``from_seq - 1``: none).

        Returns:
            The batches replayed and, when it failed, why; it never raises for what the
            endpoint does (an address that cannot be connected to is ``"replay_unreachable"``).
        """
        result = ReplayResult()
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.linger = 0
            dealer.rcvhwm = 0  # bounded by the publisher's buffer; never truncate a replay
            apply_liveness(dealer, self._liveness)
            if curve is not None:
                configure_client(dealer, curve)
            try:
                dealer.connect(endpoint)
            except zmq.ZMQError:
                result.failure = "replay_unreachable"
                return result
            await dealer.send_multipart([b"", pack_seq(from_seq)])
            result.failure = await self._receive(dealer, from_seq, through, result)
            return result
        finally:
            dealer.close(linger=0)

    async def _receive(
        self, dealer: zmq.asyncio.Socket, from_seq: int, through: int, result: ReplayResult
    ) -> str | None:
        """Collect replies until the end marker; returns why the replay failed, or ``None``."""
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        deadline = time.monotonic() + self._deadline_s
        expected = from_seq
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return "replay_deadline"
            wait_s = min(self._timeout_s, left_s)
            if not await dealer.poll(timeout=int(wait_s * 1000)):
                return "replay_timeout" if wait_s == self._timeout_s else "replay_deadline"
            # Drain what is queued without a future per message.
            while True:
                try:
                    frames = recv_frames(drain, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 4 or frames[0] != b"":
                    result.malformed.append(
                        FramingError("bad_replay_frames", f"expected 4 frames, got {len(frames)}")
                    )
                    continue
                if frames[2] == END_OF_REPLAY_SEQ:
                    if expected > through:
                        return None
                    return "replay_empty" if expected == from_seq else "replay_short"
                try:
                    seq = unpack_seq(frames[2])
                except FramingError as exc:
                    result.malformed.append(exc)
                    continue
                if seq != expected:
                    return "replay_buffer_overrun" if expected == from_seq else "replay_hole"
                expected += 1
                result.batches.append((seq, frames[3]))
