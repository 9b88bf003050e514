"""Mooncake-format trace records for tests: one record from its block ids, a trace file."""

from __future__ import annotations

import json
from pathlib import Path

from router.cluster.workload import TraceRecord


def rec(ts: int, ids: list[int], length: int | None = None, out: int = 10) -> TraceRecord:
    return TraceRecord(ts, 512 * len(ids) if length is None else length, out, ids)


def write_trace(path: Path, records: list[TraceRecord]) -> Path:
    lines = [
        json.dumps(
            {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            }
        )
        for r in records
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
