"""Recovery rules: how a worker's index entries are rebuilt when its event stream lost batches.

I/O-free. :class:`RecoveryRules` answers, for one worker, which :class:`Rebuild` follows an
orphan parent, a loss for good (a resync), a lease (re)acquisition or a stream found quiet
for too long (:class:`Silence`); :class:`StreamPosition`
tells a batch already held from a seq jump; :class:`KeptStream` holds what arrives for a
worker while its lease is on its way to this router. The router's ingest
(:mod:`router.ingest.worker`) carries the answers out against Redis, the subscriber and the
worker's snapshot; the offline replay (:mod:`router.offline.replay`) against an index with the
network taken out, so the index it rebuilds is the one the router held.

Every rebuild clears the worker's entries first. Claiming too little is safe, claiming too
much misroutes: whatever cannot be rebuilt is left out, never kept from before the loss.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

from events.subscription import ReceivedBatch

__all__ = [
    "OFFLINE_RULES",
    "KeptStream",
    "Rebuild",
    "RecoveryRules",
    "Restart",
    "Silence",
    "StreamPosition",
]


class Rebuild(enum.Enum):
    """How a worker's cleared entries are rebuilt."""

    REPLAY_FROM_START = "replay_from_start"
    """Ask the worker's replay endpoint for its stream from seq 0."""
    LOAD_SNAPSHOT = "load_snapshot"
    """Load the worker's ``GET /v1/snapshot`` (a kvroute worker)."""
    KEEP_FROM_NOW = "keep_from_now"
    """History is gone: keep what arrives from now on, orphans stored detached."""


class Silence(enum.Enum):
    """What a stream quiet for longer than the idle bound needs, once its position is known."""

    CURRENT = "current"
    """The index holds everything the publisher sent: nothing to do."""
    CATCH_UP = "catch_up"
    """Ask the replay endpoint for what came after the last seq seen (it answers with
    nothing when nothing was missed)."""
    RESTARTED = "restarted"
    """The publisher restarted unseen: rebuilt as :meth:`RecoveryRules.after_restart` says."""
    BEHIND = "behind"
    """Batches were missed and cannot be replayed: resynced as
    :meth:`RecoveryRules.after_loss` says."""
    UNKNOWN = "unknown"
    """Nothing can tell (no answer, no replay endpoint): left to the heartbeats."""


@dataclass(frozen=True, slots=True)
class RecoveryRules:
    """What one worker's lost history can be rebuilt from, and so which rebuild to use.

    Attributes:
        has_snapshot: The worker serves ``GET /v1/snapshot`` (a kvroute worker).
        can_replay: The worker has a replay endpoint.
    """

    has_snapshot: bool
    can_replay: bool

    def after_loss(self) -> Rebuild:
        """Batches were lost for good (a resync): the snapshot, or only what comes next."""
        return Rebuild.LOAD_SNAPSHOT if self.has_snapshot else Rebuild.KEEP_FROM_NOW

    def after_orphan(self, *, replaying: bool) -> Rebuild:
        """A ``BlockStored`` named a parent the index does not hold.

        A replay from seq 0 rebuilds the chain, unless there is no replay endpoint or the
        orphan came from a replay already (it would meet the same orphan again).
        """
        if self.can_replay and not replaying:
            return Rebuild.REPLAY_FROM_START
        return self.after_loss()

    def after_restart(self) -> Rebuild:
        """The publisher restarted unseen (a new lifetime whose first batches were lost):
        the snapshot; else the new lifetime replayed from seq 0 (from inside a batch, so
        a restart found outside one waits for the next batch); else only what comes next.
        """
        if self.has_snapshot:
            return Rebuild.LOAD_SNAPSHOT
        return Rebuild.REPLAY_FROM_START if self.can_replay else Rebuild.KEEP_FROM_NOW

    def after_takeover(self, *, in_batch: bool) -> Rebuild:
        """The lease was (re)acquired, or a write failed: rebuild from scratch.

        A snapshot when there is one; else a replay from seq 0, which can only be asked
        for from inside a batch (the subscriber redelivers to the task that asks).
        """
        if not self.has_snapshot and self.can_replay and in_batch:
            return Rebuild.REPLAY_FROM_START
        return self.after_loss()

    def after_silence(
        self,
        seen_seq: int | None,
        recorded_lifetime: str | None,
        reported_lifetime: str | None,
        reported_next_seq: int | None,
    ) -> Silence:
        """The stream was quiet for longer than the idle bound: is it behind its publisher?

        Args:
            seen_seq: The highest seq the router holds or was delivered (``None``: unknown).
            recorded_lifetime: The lifetime id the worker's entries were built from.
            reported_lifetime: The lifetime id the worker reports now (``None``: no answer).
            reported_next_seq: The seq its publisher assigns next, when it says (a
                kvroute worker); ``None`` where it does not (a vLLM engine).
        """
        if None not in (reported_lifetime, recorded_lifetime) and (
            reported_lifetime != recorded_lifetime
        ):
            return Silence.RESTARTED
        if reported_next_seq is not None and seen_seq is not None:
            if reported_next_seq - 1 <= seen_seq:
                return Silence.CURRENT
            return Silence.CATCH_UP if self.can_replay else Silence.BEHIND
        return Silence.CATCH_UP if self.can_replay else Silence.UNKNOWN


OFFLINE_RULES: Final = RecoveryRules(has_snapshot=False, can_replay=False)
"""The rules of a worker replayed from an event log: there is no worker to fetch a snapshot
from, and a replay from seq 0 would be the same log, meeting the same orphan."""


@dataclass(slots=True)
class StreamPosition:
    """How far a worker's stream is folded into the index.

    Attributes:
        applied_through: The highest seq whose effect the index holds. NOTE: -1 after a
            clear (the next lifetime starts at 0); ``None`` when unknown (history given
            up: the next batch is accepted whatever its seq).
        applied_ts: The timestamp of batch ``applied_through`` (``None``: unknown, e.g.
            after a snapshot).
        replaying: A replay asked for by the ingest is being delivered.
    """

    applied_through: int | None = -1
    applied_ts: float | None = None
    replaying: bool = False

    def restarted(self, seq: int, ts: float) -> bool:
        """Whether batch ``(seq, ts)`` belongs to a newer publisher lifetime than the index.

        Within one lifetime seq and timestamp grow together, so a batch the index would
        count as covered (``seq <= applied_through``) but stamped later than the last
        applied one is another batch under a reused seq: the publisher restarted, and the
        restart itself was not seen here (it happened while another router held the
        worker's lease, say).
        """
        return self.covers(seq) and self.applied_ts is not None and ts > self.applied_ts

    def first_missing(self, seq: int) -> int | None:
        """The first seq never applied when ``seq`` jumps past it (a gap or a restart).

        ``None`` when nothing is missing, when the position is unknown, and during a
        replay (which delivers what it has, in order).
        """
        applied = self.applied_through
        if applied is None or self.replaying or seq <= applied + 1:
            return None
        return applied + 1

    def covers(self, seq: int) -> bool:
        """Whether the index already holds the effect of batch ``seq``."""
        return self.applied_through is not None and seq <= self.applied_through


@dataclass(frozen=True, slots=True)
class Restart:
    """A publisher restart (a seq drop to ``seq``) seen while batches were kept."""

    seq: int


class KeptStream:
    """What a router received for a worker it owns but does not hold yet, in order:
    batches, and the publisher restarts seen between them.

    Once the lease comes with the previous holder's state, what that holder applied is
    dropped (:meth:`drop_through`) and the rest is applied in order. Bounded: past
    ``capacity`` the oldest go (a gap then, repaired like any other).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._items: deque[ReceivedBatch | Restart] = deque(maxlen=capacity)

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, item: ReceivedBatch | Restart) -> None:
        """Keep a delivered batch or a restart seen."""
        self._items.append(item)

    def first(self) -> ReceivedBatch | Restart:
        """The oldest item kept (the stream must not be empty)."""
        return self._items[0]

    def pop(self) -> None:
        """Drop the oldest item (once applied)."""
        self._items.popleft()

    def drop_through(self, seq: int | None, ts: float | None) -> None:
        """Drop everything up to and including batch ``(seq, ts)``, restarts included:
        what the previous holder applied. Nothing is dropped when that batch is not here
        (it came before this router kept any, or fell out)."""
        last = next(
            (
                i
                for i, item in enumerate(self._items)
                if isinstance(item, ReceivedBatch) and (item.seq, item.batch.ts) == (seq, ts)
            ),
            -1,
        )
        for _ in range(last + 1):
            self._items.popleft()
