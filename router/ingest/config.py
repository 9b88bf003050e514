"""Settings of the event ingest (:class:`router.ingest.service.IndexIngest`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from events.auth import SentKey
from events.curve import CurveKeyPair
from events.subscriber import SubscriberConfig
from router.ingest.watchdog import DEFAULT_IDLE_CHECK_S

__all__ = ["IngestConfig"]


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """Settings of :class:`IndexIngest`.

    Attributes:
        maintain_interval_s: Period of the lease renewal and of the maintenance pass
            (takeover of lapsed workers, rebuilds, reaping, registry sync, lifetime
            checks); keep it at most a third of the registry's lease TTL.
        snapshot_timeout_s: Timeout of one ``GET /v1/snapshot``.
        lifetime_timeout_s: Timeout of one request that reads a worker's lifetime
            (a seq jump waits for it; no answer: the jump is a gap).
        idle_check_s: A held worker's stream that delivered nothing for this long has
            its position checked (:mod:`router.ingest.watchdog`), and again after as
            long; 0 turns the checks off.
        write_retry_max_s: While Redis refuses writes for lack of memory, the longest
            wait between two probes of whether it takes them again.
        snapshot_chunk_runs: Snapshot runs written per index batch.
        group_commit: Wrap the index's store in group commit: a batch returns once
            folded, and a worker's batches that arrive while its previous write is in
            flight go to Redis together (see :mod:`router.index.group_commit`).
        subscriber: Settings of the event subscriber.
        client_keys: The router's CURVE key pair, presented to workers registered with a
            ``server_key`` (a fresh one by default: admitted by workers without an allow-list).
        worker_admin_key: The workers' admin key, sent with every request the ingest makes
            of a worker (its snapshot, its lifetime); None: no ``Authorization``.
    """

    maintain_interval_s: float = 3.0
    snapshot_timeout_s: float = 10.0
    lifetime_timeout_s: float = 2.0
    idle_check_s: float = DEFAULT_IDLE_CHECK_S
    write_retry_max_s: float = 10.0
    snapshot_chunk_runs: int = 512
    group_commit: bool = True
    subscriber: SubscriberConfig = field(default_factory=SubscriberConfig)
    client_keys: CurveKeyPair = field(default_factory=CurveKeyPair.generate)
    worker_admin_key: SentKey | None = None
