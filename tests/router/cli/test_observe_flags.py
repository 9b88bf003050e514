"""The router's observability and session flags: into the config, and refused when wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from router.cli.router_config import RouterCliError, config_from_args
from router.cli.router_flags import build_parser
from router.front.config import RouterConfig


def config(*argv: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(list(argv)), "redis://x")


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_EXPORTER_")]:
        monkeypatch.delenv(name)
    c = config()
    assert (c.sessions.bonus_tokens, c.sessions.ttl_s, c.sessions.max_entries) == (4, 600, 100_000)
    assert (c.accuracy.window_requests, c.accuracy.warn_below_ratio) == (100, 0.5)
    assert (c.accuracy.min_tokens, c.accuracy.warn_interval_s) == (1024, 600)
    assert (c.otel, c.otel_required) == (False, False)


def test_flags_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = config(
        "--session-affinity-tokens", "0", "--session-ttl-s", "30", "--session-max-entries", "9",
        "--accuracy-window-requests", "20", "--accuracy-warn-below-ratio", "0.7",
        "--accuracy-min-tokens", "10", "--accuracy-warn-interval-s", "60", "--otel",
    )  # fmt: skip
    assert not c.sessions.enabled and (c.sessions.ttl_s, c.sessions.max_entries) == (30, 9)
    assert (c.accuracy.window_requests, c.accuracy.warn_below_ratio) == (20, 0.7)
    assert (c.accuracy.min_tokens, c.accuracy.warn_interval_s) == (10, 60)
    assert (c.otel, c.otel_required) == (True, True)
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"session_affinity_tokens": 64, "accuracy_window_requests": 7}))
    c = config("--config", str(path))
    assert (c.sessions.bonus_tokens, c.accuracy.window_requests) == (64, 7)
    # The standard OpenTelemetry environment turns tracing on, but only asks for it.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert (config().otel, config().otel_required) == (True, False)


@pytest.mark.parametrize(
    "argv",
    [
        ("--session-affinity-tokens", "-1"),
        ("--session-ttl-s", "0"),
        ("--accuracy-window-requests", "0"),
        ("--accuracy-warn-below-ratio", "2"),
        ("--accuracy-min-tokens", "0"),
    ],
)
def test_bad_values_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(RouterCliError, match="invalid setting"):
        config(*argv)


def test_help_names_the_flags() -> None:
    text = build_parser().format_help()
    for flag in ("--session-affinity-tokens", "--accuracy-warn-below-ratio", "--otel"):
        assert flag in text
