"""``kvroute events dump|tail``: print an event log, or live streams, one event per line."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

from events.cli.streams import (
    add_subscriber_arguments,
    configure_logging,
    run_until_stopped,
    subscriber_settings,
)
from events.curve import CurveKeyError
from events.errors import EventDecodeError
from events.identity import WorkerId
from events.recorder import EventLogError, LogRecord, read_log
from events.schema import BlockRemoved, BlockStored, KVEventBatch, WireHash
from events.subscriber import ReceivedBatch

__all__ = ["event_rows", "format_row", "main"]

_log = logging.getLogger("kvroute.events")
_SHOWN_HASHES = 4


def _hash(value: WireHash | None) -> int | str | None:
    return value.hex() if isinstance(value, bytes) else value


def event_rows(record: LogRecord, batch: KVEventBatch | None = None) -> list[dict[str, Any]]:
    """One JSON-ready dict per event of ``record`` (one dict for a reset or resync).

    Every dict has ``worker``, ``seq``, ``ts`` (the batch's timestamp, or the receive
    time for a reset/resync), ``recv_ts``, ``type``, ``block_hashes``,
    ``parent_block_hash``, ``token_ids``, ``block_size`` and ``medium`` (``None`` where
    an event has no such field); raw-digest hashes are hex strings. An undecodable batch
    yields one row of type ``"malformed"`` with its ``reason``.

    Args:
        record: A log record.
        batch: Its batch, when already decoded.
    """
    base: dict[str, Any] = {
        "worker": record.worker_id,
        "seq": record.seq,
        "ts": record.recv_ts,
        "recv_ts": record.recv_ts,
        "type": record.kind,
        "block_hashes": None,
        "parent_block_hash": None,
        "token_ids": None,
        "block_size": None,
        "medium": None,
    }
    if record.kind != "batch":
        return [{**base, "reason": record.reason or None}]
    try:
        batch = batch or record.decode()
    except EventDecodeError as exc:
        return [{**base, "type": "malformed", "reason": exc.reason}]
    base.update(ts=batch.ts, replayed=record.replayed, dp_rank=batch.data_parallel_rank)
    rows = []
    for event in batch.events:
        row = {**base, "type": type(event).__name__}
        if isinstance(event, (BlockStored, BlockRemoved)):
            row.update(
                block_hashes=[_hash(h) for h in event.block_hashes],
                medium=event.medium,
                group_idx=event.group_idx,
            )
        if isinstance(event, BlockStored):
            row.update(
                parent_block_hash=_hash(event.parent_block_hash),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_name=event.lora_name,
            )
        rows.append(row)
    return rows


def _short(value: int | str | None) -> str:
    if value is None:
        return "-"
    return f"{value:016x}" if isinstance(value, int) and value >= 0 else str(value)[:16]


def format_row(row: dict[str, Any]) -> str:
    """A one-line, human-readable rendering of an :func:`event_rows` row."""
    when = datetime.datetime.fromtimestamp(row["ts"], datetime.timezone.utc)
    head = f"{when.isoformat(timespec='milliseconds')} {row['worker']} #{row['seq']}"
    kind = row["type"]
    if kind in ("reset", "resync", "malformed"):
        detail = f" ({row['reason']})" if row.get("reason") else ""
        return f"{head} !! {kind.upper()}{detail}"
    parts = [head, kind]
    hashes = row["block_hashes"]
    if hashes is not None:
        shown = " ".join(_short(h) for h in hashes[:_SHOWN_HASHES])
        more = f" +{len(hashes) - _SHOWN_HASHES}" if len(hashes) > _SHOWN_HASHES else ""
        parts.append(f"blocks={len(hashes)} [{shown}{more}]")
    if row["token_ids"] is not None:
        parts.append(
            f"parent={_short(row['parent_block_hash'])} tokens={len(row['token_ids'])} "
            f"block_size={row['block_size']}"
        )
    if row["medium"] is not None:
        parts.append(row["medium"])
    if row.get("replayed"):
        parts.append("(replayed)")
    return " ".join(parts)


def _print_rows(rows: Iterable[dict[str, Any]], as_json: bool, out: TextIO) -> None:
    for row in rows:
        out.write((json.dumps(row) if as_json else format_row(row)) + "\n")


class _TailSink:
    """Prints each delivered event, reset and resync; sets ``done`` after ``max_batches``."""

    def __init__(self, as_json: bool, max_batches: int | None) -> None:
        self.as_json = as_json
        self.max_batches = max_batches
        self.num_batches = 0
        self.done = asyncio.Event()

    def _emit(self, record: LogRecord, batch: KVEventBatch | None = None) -> None:
        _print_rows(event_rows(record, batch), self.as_json, sys.stdout)
        sys.stdout.flush()

    async def on_batch(self, received: ReceivedBatch) -> None:
        self._emit(LogRecord.of_batch(received), received.batch)
        self.num_batches += 1
        if self.max_batches is not None and self.num_batches >= self.max_batches:
            self.done.set()

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
        self._emit(LogRecord(time.time(), worker_id, "reset", seq))

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
        self._emit(LogRecord(time.time(), worker_id, "resync", None, reason=reason))


def _dump(args: argparse.Namespace) -> int:
    try:
        for record in read_log(args.file):
            _print_rows(event_rows(record), args.json, sys.stdout)
    except (EventLogError, OSError) as exc:
        _log.error("%s", exc)
        return 1
    return 0


def _tail(args: argparse.Namespace) -> int:
    try:
        config, streams = subscriber_settings(args)
    except (ValueError, CurveKeyError) as exc:
        _log.error("%s", exc)
        return 2
    sink = _TailSink(args.json, args.max_batches)
    _log.info("tailing %s", ", ".join(f"{s.worker_id} at {s.endpoint}" for s in streams))
    asyncio.run(run_until_stopped(sink, config, streams, sink.done))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute events", description="Inspect KV event logs and live event streams."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dump = commands.add_parser(
        "dump", help="print an event log written by `kvroute record`, one event per line"
    )
    dump.add_argument("file", help="the event log")
    dump.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per event (worker, seq, ts, type, block_hashes, "
        "parent_block_hash, token_ids, block_size, medium, ...)",
    )
    dump.add_argument(
        "--log-level", default="WARNING", help="stderr log level (default: %(default)s)"
    )
    tail = commands.add_parser(
        "tail",
        help="print live events of workers, with gap, replay, reset and resync warnings on stderr",
    )
    add_subscriber_arguments(tail)
    tail.add_argument("--json", action="store_true", help="one JSON object per event")
    tail.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="exit after this many batches (default: run until SIGINT/SIGTERM)",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``kvroute events``; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return _dump(args) if args.command == "dump" else _tail(args)
    except BrokenPipeError:
        # The reader (e.g. `head`) left: silence the final flush of stdout and stop.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
