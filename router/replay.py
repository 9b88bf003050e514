"""Rebuild the prefix index as it stood at one moment from a ``kvroute record`` event log.

The log holds what a router's event subscriber delivered (batches after gap recovery,
publisher resets, lost-for-good resyncs), each stamped with its receive time. Replaying
feeds those records, up to the chosen moment, into the router's own ingest sink over a
fresh index, so gaps, resets, clears and orphan parents are handled by the same code as
in production, not by a copy of it.

NOTE: a resync in production reloads a kvroute worker from its ``/v1/snapshot``; offline
there is no worker to ask, so the replayed index holds nothing of that worker from the
resync on until its next events: it can claim less than the router did, never more.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from events.errors import EventDecodeError
from events.recorder import LogRecord, read_log
from events.subscriber import EventSink, ReceivedBatch
from router.errors import RouterError

__all__ = [
    "LogSpan",
    "ReplayError",
    "ReplaySummary",
    "WorkerReplay",
    "feed_records",
    "log_span",
    "parse_at",
    "records_until",
]


class ReplayError(RouterError, ValueError):
    """An event log or a ``--at`` time cannot be used for replay."""


@dataclass(frozen=True, slots=True)
class LogSpan:
    """The receive times of a log's first and last records (seconds since the epoch)."""

    first_ts: float
    last_ts: float
    num_records: int


def log_span(path: str | Path) -> LogSpan:
    """Read a log once to find its time span.

    Raises:
        ReplayError: The log is empty.
        EventLogError: The file is not an event log or is corrupt.
    """
    first = last = math.nan
    count = 0
    for record in read_log(path):
        if count == 0:
            first = record.recv_ts
        last = record.recv_ts
        count += 1
    if count == 0:
        raise ReplayError(f"event log {str(path)!r} holds no records")
    return LogSpan(first, last, count)


def parse_at(text: str, span: LogSpan) -> float:
    """The moment ``--at`` names, as seconds since the epoch.

    Accepted forms: ``end`` (the last record), ``start``, ``+S`` (S seconds after the
    first record), a number of seconds since the epoch, or an ISO-8601 date and time
    (UTC unless it names an offset), e.g. ``2026-11-30T05:12:00.5``.

    Raises:
        ReplayError: The text is none of these.
    """
    value = text.strip()
    if value == "end":
        return span.last_ts
    if value == "start":
        return span.first_ts
    try:
        if value.startswith("+"):
            return span.first_ts + float(value[1:])
        return float(value)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ReplayError(
            f"--at {text!r} is not 'end', 'start', '+SECONDS', epoch seconds or an ISO-8601 "
            "time such as 2026-11-30T05:12:00"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


def records_until(records: Iterable[LogRecord], at_ts: float) -> Iterator[LogRecord]:
    """The records received at or before ``at_ts``, in log order.

    The log is in write order, which is receive order per worker; a record after
    ``at_ts`` ends the replay (later records of other workers were written later still).
    """
    for record in records:
        if record.recv_ts > at_ts:
            return
        yield record


@dataclass
class WorkerReplay:
    """What the replay fed to the index for one worker.

    Attributes:
        worker_id: The worker.
        num_batches: Batches applied.
        num_events: Events in those batches.
        num_resets: Publisher restarts (the worker's entries were dropped).
        num_resyncs: Losses replay could not repair (entries dropped).
        num_undecodable: Batches whose payload no longer decodes (skipped, as the
            router's subscriber would have).
        last_seq: Seq of the last applied batch.
        last_ts: Receive time of the worker's last record.
    """

    worker_id: str
    num_batches: int = 0
    num_events: int = 0
    num_resets: int = 0
    num_resyncs: int = 0
    num_undecodable: int = 0
    last_seq: int | None = None
    last_ts: float | None = None


@dataclass
class ReplaySummary:
    """The outcome of feeding a log to a sink.

    Attributes:
        at_ts: The moment replayed to.
        workers: Per worker, in order of first appearance.
    """

    at_ts: float
    workers: dict[str, WorkerReplay] = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        """Records fed (batches, resets and resyncs)."""
        return sum(
            w.num_batches + w.num_resets + w.num_resyncs + w.num_undecodable
            for w in self.workers.values()
        )


async def feed_records(
    records: Iterable[LogRecord], sink: EventSink, at_ts: float
) -> ReplaySummary:
    """Deliver the log's records up to ``at_ts`` to ``sink`` as the subscriber did.

    Args:
        records: The log's records (e.g. :func:`events.recorder.read_log`).
        sink: The consumer, normally the router's ingest over a fresh index.
        at_ts: The moment to stop at (seconds since the epoch).

    Returns:
        What was fed, per worker.
    """
    summary = ReplaySummary(at_ts)
    for record in records_until(records, at_ts):
        worker = summary.workers.get(record.worker_id)
        if worker is None:
            worker = summary.workers[record.worker_id] = WorkerReplay(record.worker_id)
        worker.last_ts = record.recv_ts
        if record.kind == "reset":
            worker.num_resets += 1
            await sink.on_reset(record.worker_id, record.seq or 0)
        elif record.kind == "resync":
            worker.num_resyncs += 1
            await sink.on_resync_needed(record.worker_id, record.reason or "recorded resync")
        else:
            try:
                batch = record.decode()
            except EventDecodeError:
                worker.num_undecodable += 1
                continue
            worker.num_batches += 1
            worker.num_events += len(batch.events)
            worker.last_seq = record.seq
            await sink.on_batch(
                ReceivedBatch(
                    worker_id=record.worker_id,
                    seq=record.seq or 0,
                    batch=batch,
                    payload=record.payload,
                    recv_ts=record.recv_ts,
                    replayed=record.replayed,
                )
            )
    return summary
