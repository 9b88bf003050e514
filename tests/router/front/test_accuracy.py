"""Routing accuracy, pure: expected hits, windows, warnings, the exported figures."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.errors import RouterError
from router.front.accuracy import (
    AccuracyCollector,
    AccuracyConfig,
    ReportedAccuracy,
    RoutingAccuracy,
    expected_hit_tokens,
    parse_router_accuracy,
    reported_usage,
)
from router.front.metrics import RouterMetrics

LOGGER = "test.accuracy"


@pytest.mark.parametrize(
    ("credited", "prompt", "block", "expected"),
    [
        (256, 263, 16, 256),  # a hit below the last token
        (256, 256, 16, 240),  # a block-aligned prompt: its last block is always computed
        (48, 56, 16, 48),
        (40, 56, 16, 32),  # whole blocks only
        (256, 263, 32, 256),
        (48, 263, 32, 32),  # credited in blocks of 16 by a worker of 32: one block of 32
        (0, 100, 16, 0),
        (10, 1, 16, 0),  # one token: never a hit
        (5, 0, 16, 0),
    ],
)
def test_expected_hit_tokens(credited: int, prompt: int, block: int, expected: int) -> None:
    assert expected_hit_tokens(credited, prompt, block) == expected


def test_reported_usage_reads_both_shapes() -> None:
    assert reported_usage({"prompt_tokens": 20, "cached_tokens": 16}) == (16, 20)
    vllm = {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 16}}
    assert reported_usage(vllm) == (16, 20)
    # vLLM without --enable-prompt-tokens-details: details null.
    assert reported_usage({"prompt_tokens": 20, "prompt_tokens_details": None}) == (None, 20)
    assert reported_usage(None) == (None, None)
    assert reported_usage({"cached_tokens": True, "prompt_tokens": -1}) == (None, None)
    assert reported_usage({"cached_tokens": "16"}) == (None, None)


def tracker(**kw: float) -> tuple[RoutingAccuracy, list[str]]:
    config = AccuracyConfig(**{"window_requests": 4, "min_tokens": 64, **kw})  # type: ignore[arg-type]
    log = logging.getLogger(LOGGER)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log.handlers[:] = [Keep()]
    log.propagate = False
    return RoutingAccuracy(config, log), messages


def test_agreeing_worker_scores_one_and_is_never_warned_about() -> None:
    acc, messages = tracker()
    for i in range(20):
        acc.observe("w0", 256, 256, 263, 263, now=float(i))
    figures = acc.figures()["w0"]
    assert (figures.num_requests, figures.expected_tokens, figures.reported_tokens) == (
        4, 1024, 1024
    )  # fmt: skip
    assert figures.ratio == 1.0
    assert messages == []


def test_under_promise_is_warned_once_per_interval_naming_the_tokenizer() -> None:
    acc, messages = tracker(warn_interval_s=600.0)
    acc.observe("w0", 0, 0, 56, 263, now=0.0)  # cold: nothing at stake
    for i in range(1, 4):
        acc.observe("w0", 48, 256, 56, 272, now=float(i))
    # The window is full: 144 agreed of 768 at stake.
    assert acc.figures()["w0"].ratio == pytest.approx(144 / 768)
    assert len(messages) == 1
    text = messages[0]
    assert text.startswith(
        "worker w0: routing accuracy 0.19 over its last 4 requests: it reported 768 cached "
        "prompt tokens where the router expected 144"
    )
    mismatch = "4 of them the worker counted otherwise (last: 272 prompt tokens where the "
    assert mismatch + "router counted 56)" in text
    assert "--tokenizer or --chat-template" in text
    assert "the router does not see what this worker caches" in text
    for i in range(4, 50):  # still wrong, within the interval: silent
        acc.observe("w0", 48, 256, 56, 272, now=float(i))
    assert len(messages) == 1
    acc.observe("w0", 48, 256, 56, 272, now=603.0)  # 600 s after the first warning
    assert len(messages) == 2


def test_over_promise_names_lost_removals_and_missed_restarts() -> None:
    acc, messages = tracker()
    for i in range(4):
        acc.observe("w1", 256, 0, 263, 263, now=float(i))
    assert acc.figures()["w1"].ratio == 0.0
    (text,) = messages
    assert "it reported 0 cached prompt tokens where the router expected 1,024" in text
    assert "the index claims blocks this worker does not hold" in text
    assert "BlockRemoved" in text and "PYTHONHASHSEED" in text
    assert "counted otherwise" not in text  # the prompt lengths agree


def test_no_warning_before_the_window_fills_or_with_little_at_stake() -> None:
    acc, messages = tracker(min_tokens=2000)
    for i in range(10):
        acc.observe("w0", 256, 0, 263, 263, now=float(i))  # 1,024 at stake per window
    assert messages == []
    assert acc.figures() == {}  # too little at stake: no figure
    acc2, messages2 = tracker()
    for i in range(3):  # below the window
        acc2.observe("w0", 256, 0, 263, 263, now=float(i))
    assert messages2 == []
    assert acc2.figures()["w0"].ratio == 0.0  # a figure as soon as enough is at stake


def test_window_slides() -> None:
    acc, _ = tracker(warn_below_ratio=0.0)
    for i in range(4):
        acc.observe("w0", 256, 0, 263, 263, now=float(i))
    for i in range(4):
        acc.observe("w0", 256, 256, 263, 263, now=float(4 + i))
    assert acc.figures()["w0"].ratio == 1.0  # the bad requests left the window
    acc.forget("w0")
    assert acc.figures() == {}


def test_unreported_hits_are_said_once_per_interval() -> None:
    acc, messages = tracker(warn_interval_s=10.0)
    acc.unreported("v0", 0.0)
    acc.unreported("v0", 5.0)
    acc.unreported("v1", 5.0)
    acc.unreported("v0", 10.0)
    assert [m.split()[1] for m in messages] == ["v0", "v1", "v0"]
    assert "--enable-prompt-tokens-details" in messages[0]


def test_exported_figures_read_back() -> None:
    acc, _ = tracker()
    metrics = RouterMetrics()
    metrics.registry.register(AccuracyCollector(acc.figures))
    for i in range(4):
        acc.observe("w0", 48, 256, 56, 272, now=float(i))
        metrics.expected_cached_tokens.labels("w0").inc(48)
        metrics.reported_cached_tokens.labels("w0").inc(256)
    metrics.expected_cached_tokens.labels("w1").inc(16)  # no figure yet: counters only
    text = generate_latest(metrics.registry).decode()
    assert parse_router_accuracy(text) == {
        "w0": ReportedAccuracy(192, 1024, pytest.approx(0.1875)),  # type: ignore[arg-type]
        "w1": ReportedAccuracy(16, 0, None),
    }
    assert parse_router_accuracy(generate_latest(CollectorRegistry()).decode()) == {}


@pytest.mark.parametrize(
    "bad",
    [
        {"window_requests": 0},
        {"warn_below_ratio": 1.5},
        {"min_tokens": 0},
        {"warn_interval_s": -1.0},
    ],
)
def test_config_is_checked(bad: dict[str, float]) -> None:
    with pytest.raises(RouterError):
        AccuracyConfig(**bad)  # type: ignore[arg-type]
