"""Replay client: asks a worker's replay endpoint for its batches from a seq and checks the reply.

vLLM's replay protocol over DEALER/ROUTER: the request is ``[b"", seq]``; the worker answers
``[b"", topic, seq, payload]`` per buffered batch from that seq on, then the same with the
end marker (:data:`events.framing.END_OF_REPLAY_SEQ`) as seq. A reply out of order means
the batches asked for are no longer buffered; silence means the endpoint is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

import zmq
import zmq.asyncio

from events.curve import CurveClientConfig, configure_client
from events.errors import EventDecodeError, FramingError
from events.framing import END_OF_REPLAY_SEQ, pack_seq, recv_frames, unpack_seq

__all__ = ["ReplayClient"]


class ReplayClient:
    """Makes replay requests, each over a DEALER socket that lives for that request only.

    Args:
        context: The ZeroMQ context the sockets are made in (owned by the caller).
        timeout_s: Longest silence accepted from a replay endpoint before giving up.
    """

    def __init__(self, context: zmq.asyncio.Context, timeout_s: float) -> None:
        self._context = context
        self._timeout_ms = int(timeout_s * 1000)

    async def fetch(
        self,
        endpoint: str,
        curve: CurveClientConfig | None,
        from_seq: int,
        *,
        through: int,
        on_batch: Callable[[int, bytes], Awaitable[None]],
        on_malformed: Callable[[EventDecodeError], None],
    ) -> str | None:
        """Replay from ``from_seq``; the replies must reach at least ``through`` to succeed.

        Args:
            endpoint: The worker's replay ROUTER address.
            curve: CURVE client settings when that socket is a CURVE server.
            from_seq: The first seq asked for.
            through: The last seq the replay must cover (``from_seq - 1``: none).
            on_batch: Awaited with each replayed ``(seq, payload)``, in seq order with no
                hole, before the next reply is read.
            on_malformed: Told of each reply that does not parse (it is skipped).

        Returns:
            ``None`` on success, else why the replay failed: ``"replay_timeout"``,
            ``"replay_buffer_overrun"``, ``"replay_hole"``, ``"replay_short"`` or
            ``"replay_empty"`` (see :meth:`events.subscription.EventSink.on_resync_needed`).
        """
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.linger = 0
            dealer.rcvhwm = 0  # bounded by the publisher's buffer; never truncate a replay
            if curve is not None:
                configure_client(dealer, curve)
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", pack_seq(from_seq)])
            return await self._receive(dealer, from_seq, through, on_batch, on_malformed)
        finally:
            dealer.close(linger=0)

    async def _receive(
        self,
        dealer: zmq.asyncio.Socket,
        from_seq: int,
        through: int,
        on_batch: Callable[[int, bytes], Awaitable[None]],
        on_malformed: Callable[[EventDecodeError], None],
    ) -> str | None:
        """Hand on replies until the end marker; returns why the replay failed, or ``None``."""
        expected = from_seq
        async with contextlib.aclosing(self._replies(dealer)) as replies:
            async for frames in replies:
                if frames is None:
                    return "replay_timeout"
                if len(frames) != 4 or frames[0] != b"":
                    on_malformed(
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
                    on_malformed(exc)
                    continue
                if seq != expected:
                    return "replay_buffer_overrun" if expected == from_seq else "replay_hole"
                expected += 1
                await on_batch(seq, frames[3])
        raise AssertionError("unreachable: replies end only with a timeout")

    async def _replies(
        self, dealer: zmq.asyncio.Socket
    ) -> AsyncGenerator[list[bytes] | None, None]:
        """Replay replies as they come; ``None`` after the timeout's worth of silence."""
        drain: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        while True:
            if not await dealer.poll(timeout=self._timeout_ms):
                yield None
                return
            # Drain what is queued without a future per message.
            while True:
                try:
                    frames = recv_frames(drain, zmq.NOBLOCK)
                except zmq.Again:
                    break
                yield frames
