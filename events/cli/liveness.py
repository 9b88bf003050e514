"""The flags of event sockets' connection liveness, worded once for every command that has them.

``kvroute router`` (its SUB and replay sockets) and ``kvroute worker`` (its PUB and replay
sockets) both take ``--event-heartbeat-interval-s``, ``--event-heartbeat-timeout-s`` and
``--event-tcp-keepalive-idle-s``; each maps them onto an :class:`events.liveness.SocketLiveness`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from events.liveness import KEEPALIVE_PROBES, SocketLiveness

__all__ = ["DEFAULTS", "LIVENESS_HELP", "liveness_from"]

_DEFAULT: Final = SocketLiveness()

LIVENESS_HELP: Final[dict[str, str]] = {
    "event_heartbeat_interval_s": "seconds between two ZeroMQ heartbeats (ZMTP PING, which "
    "any libzmq peer, vLLM's included, answers) on a quiet event or replay connection; "
    "0 turns them off",
    "event_heartbeat_timeout_s": "seconds an event or replay connection may stay silent "
    "after a heartbeat before it is dropped (and made again by the connecting side): "
    "bounds how long a connection whose other end vanished (a half-open one) goes unseen",
    "event_tcp_keepalive_idle_s": "seconds an event connection is idle before TCP keepalive "
    f"probes start (one every third of it; {KEEPALIVE_PROBES} unanswered drop it); 0 "
    "leaves keepalive off",
}
"""Config field (``dest``) -> the meaning of its flag (the default is added by the caller)."""

DEFAULTS: Final[dict[str, float]] = {
    "event_heartbeat_interval_s": _DEFAULT.heartbeat_interval_s,
    "event_heartbeat_timeout_s": _DEFAULT.heartbeat_timeout_s,
    "event_tcp_keepalive_idle_s": _DEFAULT.tcp_keepalive_idle_s,
}
"""Config field -> its default, in seconds."""


def liveness_from(pick: Callable[[str, float], Any]) -> SocketLiveness:
    """The liveness set by the flags; ``pick(dest, default)`` reads one setting.

    Raises:
        ValueError: A value is negative, or the timeout is shorter than the interval.
    """
    interval, timeout, idle = (float(pick(name, DEFAULTS[name])) for name in DEFAULTS)
    return SocketLiveness(interval, timeout, idle)
