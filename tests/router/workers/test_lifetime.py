"""router.workers.lifetime, pure part: a vLLM engine's lifetime from its Prometheus text."""

from __future__ import annotations

from router.workers.lifetime import process_start_time


def test_process_start_time_is_read_from_a_prometheus_exposition() -> None:
    text = (
        b"# HELP process_start_time_seconds Start time.\n"
        b"# TYPE process_start_time_seconds gauge\n"
        b"process_start_time_seconds_other 3.0\n"
        b'process_start_time_seconds{pid="7"} 1.70000000125e+09\n'
    )
    assert process_start_time(text) == "1.70000000125e+09"
    assert process_start_time(b"process_start_time_seconds 12.5\n") == "12.5"
    assert process_start_time(b"# process_start_time_seconds 1\nother 2\n") is None
