"""An event log to replay: one token chain's blocks, events of it, and a scripted scenario.

``SCENARIO`` has two workers store, extend, remove and reset blocks of ``TOKENS`` (six
blocks of four) over six seconds of log time, with a resync and orphans; the replay and
explain tests rebuild an index from it at chosen moments.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.recorder import EventLogWriter, LogRecord
from events.schema import BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch, encode_batch

BS = 4
TOKENS = list(range(100, 124))  # six blocks of four
HASHES: list[int | bytes] = [wire_hash(h) for h in hash_blocks_sha256_cbor(TOKENS, BS)]


def stored(first: int, last: int, medium: str = "GPU") -> BlockStored:
    """Blocks ``first..last-1`` of TOKENS as one event."""
    return BlockStored(
        block_hashes=HASHES[first:last],
        parent_block_hash=HASHES[first - 1] if first else None,
        token_ids=TOKENS[first * BS : last * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(*blocks: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[HASHES[b] for b in blocks], medium="GPU")


def batch(ts: float, worker: str, seq: int, *events: KVCacheEvent) -> LogRecord:
    """A log record of one batch of ``events``."""
    payload = encode_batch(KVEventBatch(ts=ts, events=list(events)))  # type: ignore[arg-type]
    return LogRecord(ts, worker, "batch", seq, payload)


def write_log(path: Path, records: Sequence[LogRecord]) -> Path:
    """Write ``records`` as an event log at ``path``; returns ``path``."""
    with EventLogWriter(path) as writer:
        for record in records:
            writer.write(record)
    return path


SCENARIO = [
    batch(100.0, "w0", 0, stored(0, 3)),
    batch(100.5, "w1", 0, stored(0, 2)),
    batch(101.0, "w0", 1, stored(3, 4)),
    batch(102.0, "w0", 2, removed(3), stored(3, 5)),
    LogRecord(103.0, "w1", "reset", 0),
    batch(103.5, "w1", 0, stored(0, 1)),
    LogRecord(104.0, "w0", "resync", None, reason="replay_failed"),
    # Blocks 1-2 after the resync: their parent (block 0) is gone for the index, so they
    # are orphans, stored detached and never claimed.
    batch(105.0, "w0", 7, stored(1, 3)),
    batch(106.0, "w0", 8, stored(0, 1)),
]
