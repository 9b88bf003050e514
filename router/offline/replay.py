"""Rebuild the prefix index as it stood at one moment from a ``kvroute record`` event log.

The log holds what an event subscriber delivered (batches after gap recovery, publisher
resets, lost-for-good resyncs), each stamped with its receive time. Replaying feeds the
records up to the chosen moment to :class:`ReplayIngest`, which folds batches with the
index's own ``apply`` (the engine-hash bridge production uses, duplicates, clears and
orphan detection included) and follows the ingest's recovery rules
(:mod:`router.ingest.recovery`) for resets, resyncs and orphan parents, so the rebuilt index is
the one the router held.

NOTE: a resync in production reloads a kvroute worker from its ``/v1/snapshot``; offline
there is no worker to ask, so the replayed index holds nothing of that worker from the
resync on until its next events: it can claim less than the router did, never more.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from events.errors import EventDecodeError
from events.identity import WorkerId
from events.recorder import LogRecord, read_log
from events.schema import BlockStored
from events.subscriber import EventSink, ReceivedBatch
from router.errors import OrphanParentError, RouterError
from router.index.base import PrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.recovery import OFFLINE_RULES, Rebuild
from router.workers.registry import WorkerRegistry

__all__ = [
    "REPLAY_LEASE_TTL_MS",
    "LogSpan",
    "ReplayError",
    "ReplayIngest",
    "ReplaySummary",
    "WorkerReplay",
    "feed_records",
    "format_ts",
    "log_span",
    "parse_at",
    "records_until",
    "redis_lease_taker",
    "replay_log",
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
        num_orphans: ``BlockStored`` events whose parent the index did not know.
        block_size: Tokens per block of its last ``BlockStored``.
        last_seq: Seq of the last applied batch.
        last_ts: Receive time of the worker's last record.
    """

    worker_id: WorkerId
    num_batches: int = 0
    num_events: int = 0
    num_resets: int = 0
    num_resyncs: int = 0
    num_undecodable: int = 0
    num_orphans: int = 0
    block_size: int | None = None
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
            for event in batch.events:
                if isinstance(event, BlockStored):
                    worker.block_size = event.block_size
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


class ReplayIngest:
    """The router's recovery rules over an index, with the network taken out (an ``EventSink``).

    Batches go through ``index.apply`` (the same fold as production); a publisher reset
    clears the worker; a resync or an orphan parent is rebuilt as
    :data:`router.ingest.recovery.OFFLINE_RULES` say (no snapshot, no replay): cleared, its
    history lost, later orphans stored detached (the ingest's path for such workers).

    Args:
        index: The index to rebuild (fresh, or a namespace of its own).
        before_first_write: Called once per worker before anything is written for it
            (the Redis index takes the worker's lease there).
    """

    def __init__(
        self,
        index: BridgedIndex,
        before_first_write: Callable[[WorkerId], Awaitable[None]] | None = None,
    ) -> None:
        self.index = index
        self.num_orphans: dict[str, int] = {}
        self._before_first_write = before_first_write
        self._known: set[WorkerId] = set()

    async def _writable(self, worker_id: WorkerId) -> WorkerId:
        wid = WorkerId(worker_id)
        if wid not in self._known:
            self._known.add(wid)
            if self._before_first_write is not None:
                await self._before_first_write(wid)
        return wid

    async def on_batch(self, received: ReceivedBatch) -> None:
        """Apply one recorded batch."""
        wid = await self._writable(received.worker_id)
        try:
            await self.index.apply(wid, received.batch)
        except OrphanParentError:
            self.num_orphans[wid] = self.num_orphans.get(wid, 0) + 1
            # The router would replay the worker from seq 0 if it could; offline that
            # replay is this same log, so the rules resync it: then the batch once more.
            await self._rebuild(wid, OFFLINE_RULES.after_orphan(replaying=False))
            await self.index.apply(wid, received.batch)

    async def on_reset(self, worker_id: WorkerId, seq: int) -> None:
        """A publisher restart: the worker's cache is new, drop its entries."""
        wid = await self._writable(worker_id)
        await self.index.clear_worker(wid)
        self.index.bridge(wid).tolerate_orphans = False

    async def on_resync_needed(self, worker_id: WorkerId, reason: str) -> None:
        """Batches were lost for good: drop the worker's entries."""
        await self._rebuild(await self._writable(worker_id), OFFLINE_RULES.after_loss())

    async def _rebuild(self, wid: WorkerId, how: Rebuild) -> None:
        """Clear the worker; offline its history is gone, so keep only what comes next."""
        assert how is Rebuild.KEEP_FROM_NOW, f"offline rules chose {how}"
        await self.index.clear_worker(wid)
        self.index.bridge(wid).tolerate_orphans = True


async def replay_log(
    path: str | Path,
    at_ts: float,
    index: BridgedIndex,
    before_first_write: Callable[[WorkerId], Awaitable[None]] | None = None,
) -> ReplaySummary:
    """Rebuild ``index`` as it stood at ``at_ts`` from the event log at ``path``.

    Args:
        path: A ``kvroute record`` log.
        at_ts: The moment, in seconds since the epoch (see :func:`parse_at`).
        index: A fresh index (or a namespace nobody else writes).
        before_first_write: See :class:`ReplayIngest`.

    Returns:
        What was applied, per worker.

    Raises:
        EventLogError: The file is not an event log or is corrupt.
    """
    sink = ReplayIngest(index, before_first_write)
    summary = await feed_records(read_log(path), sink, at_ts)
    for worker_id, count in sink.num_orphans.items():
        summary.workers[worker_id].num_orphans = count
    return summary


REPLAY_LEASE_TTL_MS: Final = 7 * 24 * 3600 * 1000
"""Leases a replay takes in its Redis namespace: long, so the rebuilt index stays for study."""


def redis_lease_taker(
    index: PrefixIndex, registry: WorkerRegistry
) -> Callable[[WorkerId], Awaitable[None]]:
    """A ``before_first_write`` hook that takes each worker's lease in the namespace.

    Raises (from the hook):
        ReplayError: Another writer holds the worker's lease: the namespace is live.
    """

    async def take(worker_id: WorkerId) -> None:
        await registry.hold()  # live for as long as the lease lasts: routers leave it alone
        lease = await registry.acquire(worker_id)
        if lease is None:
            raise ReplayError(
                f"worker {worker_id!r} is leased by another writer in namespace "
                f"{registry.layout.namespace!r}: replay into a namespace of its own"
            )
        index.use_lease(worker_id, lease.token)

    return take


def format_ts(ts: float) -> str:
    """``ts`` (seconds since the epoch) as an ISO-8601 UTC time with milliseconds."""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds")
