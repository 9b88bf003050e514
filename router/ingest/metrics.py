"""Prometheus metric objects of the router, registered in a registry the caller owns.

Nothing registers in ``prometheus_client``'s global default registry, so several routers
(or tests) in one process keep separate counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from events.identity import WorkerId
from events.subscriber import WorkerCounters

__all__ = ["IngestMetrics", "StreamCollector"]


class StreamCollector(Collector):
    """Exports an ``EventSubscriber``'s per-worker stream counters (``kvroute_stream_*``).

    Args:
        read: Returns worker id -> counters snapshot at scrape time.
    """

    def __init__(self, read: Callable[[], Mapping[WorkerId, WorkerCounters]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = self._read()
        plain = {
            "batches": ("num_batches", "Batches delivered (live and replayed)."),
            "replayed_batches": ("num_replayed", "Batches delivered through replay."),
            "gaps": ("num_gaps", "Seq gaps seen on the live stream."),
            "missed_batches": ("num_missed", "Seqs missing in those gaps, before replay."),
            "replays": ("num_replays", "Replay requests made."),
            "resets": ("num_resets", "Publisher restarts seen."),
            "duplicates": ("num_duplicates", "Batches received again and skipped."),
            "handshake_failures": ("num_handshake_failures", "Failed ZeroMQ handshakes."),
            "resubscribes": (
                "num_resubscribes",
                "Connections dropped and made again on "
                "purpose (a quiet stream found behind its publisher).",
            ),
        }
        for name, (attr, doc) in plain.items():
            family = CounterMetricFamily(f"kvroute_stream_{name}", doc, labels=["worker"])
            for worker, c in counters.items():
                family.add_metric([worker], getattr(c, attr))
            yield family
        for name, attr, label, doc in (
            ("stream_malformed", "malformed", "reason", "Malformed messages skipped, by reason."),
            ("stream_resyncs", "resyncs", "reason", "Resync signals, by reason."),
            ("ingest_task_restarts", "task_restarts", "task",
             "Restarts of a worker's event tasks (reader, monitor) after an unexpected "
             "failure (logged with the worker id)."),
        ):  # fmt: skip
            family = CounterMetricFamily(f"kvroute_{name}", doc, labels=["worker", label])
            for worker, c in counters.items():
                for reason, value in getattr(c, attr).items():
                    family.add_metric([worker, reason], value)
            yield family


@dataclass
class IngestMetrics:
    """Counters of event ingest into the prefix index (``kvroute_ingest_*``).

    Every malformed, skipped, orphaned, replayed or resynced thing is counted here
    (no silent loss). Labels are bounded: worker ids and short fixed reasons.

    Args:
        registry: Where the metrics are registered (a fresh one by default).
    """

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.batches = Counter(
            "kvroute_ingest_batches",
            "Event batches received, by outcome (applied, covered, not_owner, failed, "
            "unknown_worker, index_full: dropped while Redis refuses writes).",
            ["worker", "outcome"],
            registry=r,
        )
        self.events = Counter(
            "kvroute_ingest_events",
            "Events in applied batches, by type.",
            ["worker", "type"],
            registry=r,
        )
        self.skipped = Counter(
            "kvroute_ingest_skipped",
            "Parts of events the index did not apply, by reason (malformed, "
            "unknown_removals, detached, ignored_groups, block_size_mismatch: a BlockStored "
            "whose block size is not the worker's registered one).",
            ["worker", "reason"],
            registry=r,
        )
        self.orphans = Counter(
            "kvroute_ingest_orphan_parents",
            "BlockStored events whose parent hash the index did not know.",
            ["worker"],
            registry=r,
        )
        self.replays = Counter(
            "kvroute_ingest_replays",
            "Replays the ingest asked for, by outcome (ok, failed).",
            ["worker", "outcome"],
            registry=r,
        )
        self.resyncs = Counter(
            "kvroute_ingest_resyncs",
            "Worker resyncs (entries dropped and rebuilt), by reason.",
            ["worker", "reason"],
            registry=r,
        )
        self.snapshots = Counter(
            "kvroute_ingest_snapshots",
            "Snapshot loads from kvroute workers, by outcome (ok, failed).",
            ["worker", "outcome"],
            registry=r,
        )
        self.resets = Counter(
            "kvroute_ingest_resets",
            "Publisher restarts seen (the worker's entries were cleared).",
            ["worker"],
            registry=r,
        )
        self.lease_lost = Counter(
            "kvroute_ingest_leases_lost",
            "Leases this router found lapsed or taken while it was the writer.",
            ["worker"],
            registry=r,
        )
        self.redis_errors = Counter(
            "kvroute_ingest_redis_errors",
            "Index writes that failed on a Redis error (the worker is resynced).",
            ["worker"],
            registry=r,
        )
        self.handovers = Counter(
            "kvroute_ingest_handovers",
            "Leases this router gave to the replica that owns the worker by rendezvous "
            "hashing (router replicas joined or left).",
            ["worker"],
            registry=r,
        )
        self.handoffs = Counter(
            "kvroute_ingest_handoffs",
            "Lease handoffs carrying a worker's state, by outcome: sent (this router passed "
            "a lease on with its state), resumed (took one over and continued the stream), "
            "stale (someone held the lease in between: rebuilt instead), invalid "
            "(unreadable: rebuilt instead).",
            ["worker", "outcome"],
            registry=r,
        )
        self.idle_checks = Counter(
            "kvroute_ingest_idle_checks",
            "Position checks of streams quiet for longer than the idle bound or just "
            "reconnected, by outcome: current (nothing missed), replayed (missed batches "
            "replayed), resynced (missed and not replayable), restarted (a new publisher "
            "lifetime; reset), unknown (nothing could tell).",
            ["worker", "outcome"],
            registry=r,
        )
        self.data_losses = Counter(
            "kvroute_index_data_losses",
            "Redis nodes found to have lost their data (restarted empty, a shard flushed): "
            "this router's marker on them was gone (router.store.markers).",
            registry=r,
        )
        self.restores = Counter(
            "kvroute_ingest_restores",
            "Workers whose entries this router wrote again from what it held of them, "
            "after Redis lost them.",
            ["worker"],
            registry=r,
        )
        self.reaped = Counter(
            "kvroute_ingest_reaped_workers",
            "Workers whose lease lapsed and whose entries this router removed.",
            registry=r,
        )
        self.owned = Gauge(
            "kvroute_ingest_owned_workers",
            "Workers whose lease this router holds (it writes their entries).",
            registry=r,
        )
        self.block_size_mismatch = Gauge(
            "kvroute_ingest_block_size_mismatch",
            "1 while a worker's events carry a block size other than its registration's "
            "(those BlockStored events are dropped: fix the registration).",
            ["worker"],
            registry=r,
        )
        self.write_errors = Counter(
            "kvroute_index_write_errors",
            "Index writes Redis refused, by reason (oom: out of memory at maxmemory; "
            "unreachable: no connection or no answer).",
            ["reason"],
            registry=r,
        )
        self.writable = Gauge(
            "kvroute_index_writable",
            "1 while Redis takes index writes; 0 while it refuses them for lack of memory "
            "(batches are dropped, their workers rebuilt once it takes them again).",
            registry=r,
        )
