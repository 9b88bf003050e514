"""The event sockets' liveness flags of ``kvroute worker``: seconds, as the router's."""

from __future__ import annotations

from events.liveness import SocketLiveness
from pool.worker.config import config_from_args
from pool.worker.flags import build_parser

FLAGS = [
    "--event-heartbeat-interval-s", "2",
    "--event-heartbeat-timeout-s", "8",
    "--event-tcp-keepalive-idle-s", "0",
]  # fmt: skip


def test_the_worker_takes_them_as_seconds() -> None:
    config = config_from_args(build_parser().parse_args(FLAGS))
    assert (
        config.event_heartbeat_interval_s,
        config.event_heartbeat_timeout_s,
        config.event_tcp_keepalive_idle_s,
    ) == (2.0, 8.0, 0.0)
    default = config_from_args(build_parser().parse_args([]))
    assert default.event_heartbeat_interval_s == SocketLiveness().heartbeat_interval_s
