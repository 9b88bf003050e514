"""The event connections' liveness flags of ``kvroute router``: parsed into one
SocketLiveness (flags and config file alike), bad values refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.liveness import SocketLiveness
from router.cli.router_config import RouterCliError, config_from_args
from router.cli.router_flags import build_parser as router_parser
from router.ingest.watchdog import DEFAULT_IDLE_CHECK_S

FLAGS = [
    "--event-heartbeat-interval-s", "2",
    "--event-heartbeat-timeout-s", "8",
    "--event-tcp-keepalive-idle-s", "0",
]  # fmt: skip


def test_the_router_takes_them_from_flags_and_its_config_file(tmp_path: Path) -> None:
    config = config_from_args(router_parser().parse_args(FLAGS), "redis://x")
    assert config.event_liveness == SocketLiveness(2.0, 8.0, 0.0)
    assert config.event_idle_check_s == DEFAULT_IDLE_CHECK_S
    file = tmp_path / "router.json"
    file.write_text(json.dumps({"event_heartbeat_interval_s": 1, "event_idle_check_s": 0}))
    args = router_parser().parse_args(["--config", str(file)])
    config = config_from_args(args, "redis://x")
    assert config.event_liveness == SocketLiveness(heartbeat_interval_s=1.0)
    assert config.event_idle_check_s == 0.0
    defaults = config_from_args(router_parser().parse_args([]), "redis://x")
    assert defaults.event_liveness == SocketLiveness()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--event-heartbeat-interval-s", "10", "--event-heartbeat-timeout-s", "5"],
         "at least the heartbeat interval"),
        (["--event-idle-check-s", "-1"], "--event-idle-check-s must be >= 0"),
    ],
)  # fmt: skip
def test_the_router_refuses_bad_values(argv: list[str], message: str) -> None:
    with pytest.raises(RouterCliError, match=message):
        config_from_args(router_parser().parse_args(argv), "redis://x")
