"""``kvroute replay``: rebuild the prefix index at one moment of an event log and summarise it.

The index is rebuilt in memory (``--memory``, the default) or in a Redis namespace of its
own (``--redis URL``), where it stays for ``kvroute index stats`` or a router to look at.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.recorder import EventLogError
from router.errors import RouterError
from router.index.base import IndexStats
from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.offline.replay import (
    REPLAY_LEASE_TTL_MS,
    LogSpan,
    ReplaySummary,
    format_ts,
    log_span,
    parse_at,
    redis_lease_taker,
    replay_log,
)
from router.store.connection import connect, redact_url
from router.store.layout import KeyLayout
from router.workers.registry import WorkerRegistry

__all__ = ["add_replay_arguments", "main", "run_offline", "summary_json", "summary_text"]

_LOG: Final = logging.getLogger("kvroute.replay")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``kvroute replay`` and ``kvroute explain`` share: the log and the moment."""
    p.add_argument("log", type=Path, help="event log written by `kvroute record`")
    p.add_argument(
        "--at",
        default="end",
        metavar="TIME",
        help="the moment to rebuild: 'end' (default), 'start', '+SECONDS' after the first "
        "record, seconds since the epoch, or an ISO-8601 time (UTC unless an offset is given, "
        "e.g. 2026-11-30T05:12:00.5)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="router key seed of the cluster (default: 0, as the router)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute replay",
        description="Rebuild the global prefix index as it stood at one moment from a "
        "`kvroute record` log, applying gaps, resets, clears and orphan parents as the "
        "router does, and print per-worker figures.",
    )
    add_replay_arguments(p)
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--memory", action="store_true", help="rebuild in memory (default: yes, unless --redis)"
    )
    target.add_argument(
        "--redis",
        metavar="URL",
        help="rebuild in this Redis, under --namespace, and leave it there for inspection",
    )
    p.add_argument(
        "--namespace",
        help="Redis namespace to rebuild into (default: replay-<current UTC time>); must be "
        "one no router writes",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def summary_json(
    summary: ReplaySummary, span: LogSpan, entries: dict[str, int], stats: IndexStats
) -> dict[str, Any]:
    """The replay's outcome as one JSON object."""
    return {
        "at": summary.at_ts,
        "at_iso": format_ts(summary.at_ts),
        "first_ts": span.first_ts,
        "records_applied": summary.num_records,
        "records_in_log": span.num_records,
        "workers": {
            w.worker_id: {
                "batches": w.num_batches,
                "events": w.num_events,
                "resets": w.num_resets,
                "resyncs": w.num_resyncs,
                "orphans": w.num_orphans,
                "undecodable": w.num_undecodable,
                "last_seq": w.last_seq,
                "entries": entries.get(w.worker_id, 0),
            }
            for w in summary.workers.values()
        },
        "index": {
            "entries": stats.num_entries,
            "keys": stats.num_keys,
            "workers": stats.num_workers,
        },
    }


def summary_text(
    summary: ReplaySummary, span: LogSpan, entries: dict[str, int], stats: IndexStats
) -> str:
    """The replay's outcome as a table."""
    lines = [
        f"replayed to {format_ts(summary.at_ts)} ({summary.at_ts - span.first_ts:+.3f} s from "
        f"the first record): {summary.num_records} of {span.num_records} records",
    ]
    header = ("worker", "batches", "events", "resets", "resyncs", "orphans", "last seq", "entries")
    rows = [header] + [
        (
            w.worker_id,
            str(w.num_batches),
            str(w.num_events),
            str(w.num_resets),
            str(w.num_resyncs),
            str(w.num_orphans),
            "-" if w.last_seq is None else str(w.last_seq),
            str(entries.get(w.worker_id, 0)),
        )
        for w in summary.workers.values()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells))
    lines.append(
        f"index: {stats.num_entries} entries, {stats.num_keys} keys, {stats.num_workers} workers"
    )
    return "\n".join(lines)


async def worker_entries(index: BridgedIndex, summary: ReplaySummary) -> dict[str, int]:
    """Entries each replayed worker holds in ``index``."""
    counts: dict[str, int] = {}
    for worker_id in summary.workers:
        held = await index.worker_entries(WorkerId(worker_id))
        counts[worker_id] = len(held)
    return counts


WriteHook = Callable[[WorkerId], Awaitable[None]] | None


@contextlib.asynccontextmanager
async def replay_target(
    redis_url: str | None, namespace: str | None, seed: int
) -> AsyncIterator[tuple[BridgedIndex, WriteHook, str | None]]:
    """Yield ``(index, before_first_write, where)`` for a memory or Redis rebuild;
    ``where`` says where the rebuilt index stays (None: in memory, gone at exit)."""
    keyer = RouterKeyer(seed)
    if redis_url is None:
        yield BridgedIndex(MemoryPrefixIndex(), keyer), None, None
        return
    client = await connect(redis_url)
    try:
        layout = KeyLayout(namespace or time.strftime("replay-%Y%m%dT%H%M%S", time.gmtime()))
        store = RedisPrefixIndex(client, layout)
        registry = WorkerRegistry(client, layout, lease_ttl_ms=REPLAY_LEASE_TTL_MS)
        where = f"{redact_url(redis_url)} namespace {layout.namespace!r}"
        yield BridgedIndex(store, keyer), redis_lease_taker(store, registry), where
    finally:
        await client.aclose()


async def _run(args: argparse.Namespace) -> int:
    span = log_span(args.log)
    at_ts = parse_at(args.at, span)
    async with replay_target(args.redis, args.namespace, args.seed) as (index, hook, where):
        summary = await replay_log(args.log, at_ts, index, hook)
        entries = await worker_entries(index, summary)
        stats = await index.stats()
        if args.json:
            print(json.dumps(summary_json(summary, span, entries, stats), indent=2))
        else:
            print(summary_text(summary, span, entries, stats))
        if where is not None:
            print(f"index left in {where}", file=sys.stderr)
    return 0


def run_offline(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
    errors: tuple[type[Exception], ...],
    log: logging.Logger,
) -> int:
    """Run an offline command (replay, explain) on ``argv``: log lines on stderr prefixed
    with the command's name (debug ones with ``--verbose``), each of ``errors`` logged as
    one line to ``log`` and exit code 1; else ``run``'s exit code."""
    args = parser.parse_args(list(argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=f"{parser.prog}: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(run(args))
    except errors as exc:
        log.error("%s", exc)
        return 1


def main(argv: Sequence[str]) -> int:
    """Run ``kvroute replay``; returns the exit code."""
    return run_offline(_parser(), argv, _run, (RouterError, EventLogError, OSError), _LOG)
