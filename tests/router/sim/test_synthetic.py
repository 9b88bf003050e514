"""Synthetic traces: shifted copies of a trace, generated chat sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cluster.workload import TRACE_BLOCK_TOKENS, TraceRecord, read_trace
from router.sim.synthetic import chat_sessions, shifted_copies, write_trace
from router.sim.trace import SimError, to_requests


def test_shifted_copies_multiply_the_working_set_and_keep_the_rate() -> None:
    trace = [TraceRecord(1000, 600, 5, [0, 1]), TraceRecord(3000, 512, 5, [0])]
    copies = shifted_copies(trace, 2)
    # Copy 0 at 2 x (t - start) + 0, copy 1 the same plus the original span (2 s).
    assert [(r.timestamp, r.hash_ids) for r in copies] == [
        (0, [0, 1]),
        (2000, [2, 3]),
        (4000, [0]),
        (6000, [2]),
    ]
    assert [(r.timestamp, r.hash_ids) for r in shifted_copies(trace, 1)] == [
        (0, [0, 1]),
        (2000, [0]),
    ]
    assert shifted_copies([], 3) == []
    with pytest.raises(SimError, match="copies must be >= 1"):
        shifted_copies(trace, 0)
    with pytest.raises(SimError, match="32 bits"):
        shifted_copies([TraceRecord(0, 512, 1, [2**31])], 2)


def test_chat_sessions_are_valid_deterministic_and_extend_whole_blocks(tmp_path: Path) -> None:
    records = chat_sessions(num_sessions=40, seed=3)
    assert records == chat_sessions(num_sessions=40, seed=3)
    assert records != chat_sessions(num_sessions=40, seed=4)
    path = tmp_path / "chats.jsonl"
    write_trace(path, records)
    assert read_trace(path) == records
    requests = to_requests(records)  # ids and lengths agree, time goes forward
    assert len(requests) == len(records)
    # Each session's next turn shares every full block of its previous prompt, but not
    # the partial last one: the next turn completes it with other tokens.
    by_first: dict[int, list[TraceRecord]] = {}
    for r in records:
        by_first.setdefault(r.hash_ids[0], []).append(r)
    followed = 0
    for r in records:
        full = r.input_length // TRACE_BLOCK_TOKENS
        later = [
            s
            for s in records
            if s.timestamp > r.timestamp
            and s.hash_ids[:full] == r.hash_ids[:full]
            and len(s.hash_ids) > len(r.hash_ids)
        ]
        if later and r.input_length % TRACE_BLOCK_TOKENS:
            followed += 1
            assert all(s.hash_ids[full] != r.hash_ids[full] for s in later)
    assert followed > 10
    # System prompts are shared across sessions: some first block starts many sessions.
    assert max(len(v) for v in by_first.values()) >= 10
    with pytest.raises(SimError, match="must be positive"):
        chat_sessions(num_sessions=0)
