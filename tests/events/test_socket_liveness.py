"""Connection liveness of event sockets (events.liveness): the options, and what they do.

A publisher process frozen with SIGSTOP keeps its TCP connection open (its kernel still
acknowledges) but its libzmq answers no heartbeat: a subscriber with heartbeats drops the
connection within the timeout, and makes it again once the publisher runs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from events.liveness import KEEPALIVE_PROBES, SocketLiveness, apply_liveness
from tests.support.polling import wait_until

PUBLISHER = """
import sys, time, zmq
pub = zmq.Context().socket(zmq.PUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    pub.send(b"tick")
    time.sleep(0.05)
"""


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("liveness", "expected"),
    [
        (
            SocketLiveness(2.5, 10.0, 45.0),
            {zmq.HEARTBEAT_IVL: 2500, zmq.HEARTBEAT_TIMEOUT: 10000, zmq.HEARTBEAT_TTL: 10000,
             zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: 45, zmq.TCP_KEEPALIVE_INTVL: 15,
             zmq.TCP_KEEPALIVE_CNT: KEEPALIVE_PROBES},
        ),
        # Zero: heartbeats off, keepalive as the system has it.
        (SocketLiveness(0.0, 0.0, 0.0), {zmq.HEARTBEAT_IVL: 0, zmq.TCP_KEEPALIVE: -1}),
    ],
)  # fmt: skip
def test_the_options_are_set_in_milliseconds_and_seconds(
    context: zmq.Context[zmq.Socket[bytes]], liveness: SocketLiveness, expected: dict[int, int]
) -> None:
    sock = context.socket(zmq.SUB)
    apply_liveness(sock, liveness)
    assert {option: sock.getsockopt(option) for option in expected} == expected


@pytest.mark.parametrize(
    ("interval_s", "timeout_s", "idle_s", "message"),
    [
        (-1.0, 20.0, 60.0, ">= 0 seconds"),
        (5.0, 2.0, 60.0, "at least the heartbeat interval"),
        (5.0, 7000.0, 60.0, "at most 6553.5 s"),
    ],
)
def test_bad_settings_are_refused(
    interval_s: float, timeout_s: float, idle_s: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SocketLiveness(interval_s, timeout_s, idle_s)


@pytest.mark.slow
def test_a_frozen_publisher_is_dropped_and_reconnected_once_it_runs(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert publisher.stdout is not None
        port = int(publisher.stdout.readline())
        sub = context.socket(zmq.SUB)
        sub.linger = 0
        apply_liveness(sub, SocketLiveness(0.2, 1.0, 0.0))
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.subscribe(b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        events: list[int] = []

        def seen(event: int) -> bool:
            while monitor.poll(0):
                events.append(parse_monitor_message(monitor.recv_multipart())["event"])
            return event in events

        def receives() -> bool:
            while sub.poll(0):
                sub.recv()
                return True
            return False

        wait_until(receives, "a message from the publisher")
        publisher.send_signal(signal.SIGSTOP)  # its TCP stays open; its heartbeats stop
        wait_until(lambda: seen(zmq.EVENT_DISCONNECTED), "the heartbeat timeout to drop it")
        events.clear()
        publisher.send_signal(signal.SIGCONT)
        wait_until(lambda: seen(zmq.EVENT_HANDSHAKE_SUCCEEDED), "the connection made again")
        while sub.poll(0):  # what was queued before the freeze
            sub.recv()
        wait_until(receives, "a message after the reconnection")
        sub.disable_monitor()
        monitor.close(linger=0)
    finally:
        publisher.kill()
        publisher.wait()
