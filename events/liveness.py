"""Connection liveness of event sockets: ZMTP heartbeats and TCP keepalive, set one way.

A SUB socket that only reads never writes on its TCP connection, so when the publisher's
side of that connection is gone (its host's kernel gave up retransmitting during a
partition, or a NAT forgot the idle flow) nothing ever tells the subscriber: its side
stays ESTABLISHED and the stream is silently dead. ZMTP heartbeats make each side send
``PING`` every ``heartbeat_interval_s``; any libzmq peer (4.2 and later, vLLM's included)
answers ``PONG`` by itself. A dead peer either resets the connection at the first
``PING`` (its socket is gone) or stays silent, and the connection is dropped after
``heartbeat_timeout_s`` without traffic; ZeroMQ then reconnects by itself. The
``PING`` also carries ``heartbeat_timeout_s`` as its TTL, so the peer drops a connection
whose pings stopped. TCP keepalive is the kernel's own, slower check below it, and keeps
idle flows alive in middleboxes that expire them.

I/O-free apart from setting socket options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import zmq

__all__ = ["KEEPALIVE_PROBES", "SocketLiveness", "apply_liveness"]

KEEPALIVE_PROBES: Final = 3
"""Unanswered TCP keepalive probes after which the kernel drops a connection."""


@dataclass(frozen=True, slots=True)
class SocketLiveness:
    """How an event socket checks that its connections are alive.

    Attributes:
        heartbeat_interval_s: Seconds between two ZMTP ``PING``\\ s on an otherwise quiet
            connection; 0 turns heartbeats off.
        heartbeat_timeout_s: Seconds without any traffic (a ``PONG`` included) after a
            ``PING`` before the connection is dropped (and, on the connecting side,
            made again); also the TTL announced to the peer.
        tcp_keepalive_idle_s: Seconds a connection is idle before the kernel's keepalive
            probes start (then one every third of it, :data:`KEEPALIVE_PROBES` unanswered
            ones drop it); 0 leaves keepalive off.
    """

    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 20.0
    tcp_keepalive_idle_s: float = 60.0

    def __post_init__(self) -> None:
        values = (self.heartbeat_interval_s, self.heartbeat_timeout_s, self.tcp_keepalive_idle_s)
        if min(values) < 0:
            raise ValueError(f"liveness settings must be >= 0 seconds, got {values}")
        if self.heartbeat_interval_s > 0 and self.heartbeat_timeout_s < self.heartbeat_interval_s:
            raise ValueError(
                f"the heartbeat timeout ({self.heartbeat_timeout_s:g} s) must be at least "
                f"the heartbeat interval ({self.heartbeat_interval_s:g} s): a peer gets "
                "one interval to answer"
            )
        # ZMQ_HEARTBEAT_TTL travels in deciseconds in a 16-bit field.
        if self.heartbeat_timeout_s > 6553.5:
            raise ValueError(
                f"the heartbeat timeout must be at most 6553.5 s, got {self.heartbeat_timeout_s:g}"
            )


def apply_liveness(sock: zmq.Socket[Any], liveness: SocketLiveness) -> None:
    """Set ``liveness`` on ``sock``; call it before the socket binds or connects (ZeroMQ
    applies these options to connections made afterwards)."""
    if liveness.heartbeat_interval_s > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(liveness.heartbeat_interval_s))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(liveness.heartbeat_timeout_s))
        sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(liveness.heartbeat_timeout_s))
    if liveness.tcp_keepalive_idle_s > 0:
        idle = max(1, round(liveness.tcp_keepalive_idle_s))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, idle // 3))
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
