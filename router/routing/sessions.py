"""Session affinity: which worker served each session last, as a bonus in the routing cost.

A request that carries a session key (``X-Session-Id``, else the body's ``user``) prefers
the worker that served its session before: that worker's candidate gets
``Candidate.session_bonus_tokens``, which cost-based policies subtract (at the prefill
weight) from its score, exactly as if it cached that many more prompt tokens. Load still
decides when it differs by more than the bonus is worth.

Why a bonus and not a pin: the index already sends a conversation back to the worker that
caches its earlier turns. The session says more only where the index cannot see: the
moment between a turn's answer and its ``BlockStored`` events, a turn whose prompt was
rewritten (a RAG context swapped, a summarised history), state outside the KV cache. That
is worth a little, never a hot spot: the default bonus is 4 tokens, 128 at the default
prefill weight (32), half of one in-flight request (``per_request`` = 256), so the
session's worker wins ties and near-ties and loses to any worker with one request less.

:class:`SessionTable` is the bounded map session key -> (worker, last seen); the router
records the worker that actually served each request (after any failover).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from events.identity import WorkerId
from router.errors import RouterError
from router.routing.policies import Candidate

__all__ = ["SessionConfig", "SessionTable", "with_session_bonus"]


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Session affinity settings.

    Attributes:
        bonus_tokens: Prompt tokens the session's worker is credited with, as if cached
            (0 turns affinity off). See the module doc for the default.
        ttl_s: A session not seen for this long is forgotten (its worker's cache has most
            likely moved on too).
        max_entries: Most sessions remembered; past it the least recently seen go first
            (about 200 bytes each: 20 MB at the default).
    """

    bonus_tokens: int = 4
    ttl_s: float = 600.0
    max_entries: int = 100_000

    def __post_init__(self) -> None:
        if self.bonus_tokens < 0:
            raise RouterError(f"session bonus tokens must be >= 0, got {self.bonus_tokens}")
        if not self.ttl_s > 0:
            raise RouterError(f"session TTL must be > 0 s, got {self.ttl_s}")
        if self.max_entries < 1:
            raise RouterError(f"session max entries must be >= 1, got {self.max_entries}")

    @property
    def enabled(self) -> bool:
        """Whether sessions affect routing at all."""
        return self.bonus_tokens > 0


class SessionTable:
    """Session key -> the worker that served it last, bounded and least-recently-used.

    NOTE: insertion order is recency order (a hit or a record moves the key to the end),
    so expiry and eviction only ever look at the front.

    Args:
        config: Bounds and lifetime.
    """

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._entries: OrderedDict[str, tuple[WorkerId, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def worker_of(self, key: str, now: float) -> WorkerId | None:
        """The worker that served session ``key`` within the TTL, or ``None``."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        worker, seen = entry
        if now - seen > self.config.ttl_s:
            del self._entries[key]
            return None
        return worker

    def record(self, key: str, worker: WorkerId, now: float) -> None:
        """Session ``key`` was (or is being) served by ``worker``."""
        self._entries[key] = (worker, now)
        self._entries.move_to_end(key)
        self._expire(now)
        while len(self._entries) > self.config.max_entries:
            self._entries.popitem(last=False)

    def forget_worker(self, worker: WorkerId) -> None:
        """Drop every session of ``worker`` (it left the cluster)."""
        for key in [k for k, (w, _) in self._entries.items() if w == worker]:
            del self._entries[key]

    def _expire(self, now: float) -> None:
        ttl = self.config.ttl_s
        while self._entries:
            _, (_, seen) = next(iter(self._entries.items()))
            if now - seen <= ttl:
                return
            self._entries.popitem(last=False)


def with_session_bonus(
    candidates: Sequence[Candidate], worker: WorkerId | None, bonus_tokens: int
) -> list[Candidate]:
    """``candidates`` with ``worker``'s entry given the session bonus (unchanged when the
    worker is not among them, e.g. its circuit is open, or the bonus is 0)."""
    if worker is None or bonus_tokens <= 0:
        return list(candidates)
    return [
        msgspec.structs.replace(c, session_bonus_tokens=bonus_tokens)
        if c.worker_id == worker
        else c
        for c in candidates
    ]
