"""Replay's time handling: the log's span, ``--at`` forms, and where a replay stops."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from events.recorder import EventLogWriter, LogRecord, read_log
from router.offline.replay import LogSpan, ReplayError, log_span, parse_at, records_until

SPAN = LogSpan(first_ts=1_800_000_000.0, last_ts=1_800_000_060.0, num_records=3)


def _write(path: Path, records: list[LogRecord]) -> None:
    with EventLogWriter(path) as writer:
        for record in records:
            writer.write(record)


def test_parse_at_accepts_every_documented_form() -> None:
    assert parse_at("end", SPAN) == SPAN.last_ts
    assert parse_at("start", SPAN) == SPAN.first_ts
    assert parse_at("+12.5", SPAN) == SPAN.first_ts + 12.5
    assert parse_at("1800000001.25", SPAN) == 1_800_000_001.25
    expected = dt.datetime(2026, 11, 30, 5, 12, tzinfo=dt.timezone.utc).timestamp()
    assert parse_at("2026-11-30T05:12:00", SPAN) == expected
    assert parse_at("2026-11-30T05:12:00Z", SPAN) == expected
    assert parse_at("2026-11-30T06:12:00+01:00", SPAN) == expected


def test_parse_at_rejects_garbage_with_the_accepted_forms() -> None:
    with pytest.raises(ReplayError, match=r"'\+SECONDS'"):
        parse_at("yesterday", SPAN)


def test_log_span_and_stop_time(tmp_path: Path) -> None:
    path = tmp_path / "events.kvlog"
    records = [
        LogRecord(100.0, "w0", "batch", 0, b""),
        LogRecord(101.0, "w1", "reset", 3),
        LogRecord(102.0, "w0", "resync", None, reason="gap"),
    ]
    _write(path, records)
    assert log_span(path) == LogSpan(100.0, 102.0, 3)
    assert list(records_until(read_log(path), 101.0)) == records[:2]
    assert list(records_until(read_log(path), 99.0)) == []
    # A record received at or before the moment but written after a later one was
    # delivered after the moment (held back behind a replay): the replay stops first.
    held_back = [records[0], LogRecord(105.0, "w0", "batch", 2), LogRecord(101.5, "w0", "batch", 3)]
    assert list(records_until(held_back, 103.0)) == [records[0]]


def test_empty_log_has_no_span(tmp_path: Path) -> None:
    path = tmp_path / "empty.kvlog"
    _write(path, [])
    with pytest.raises(ReplayError, match="no records"):
        log_span(path)
