"""QuietSchedule: when each of many things is next due for a check, backing off while it is quiet.

A router polls every worker's ``/health`` and asks for its publisher lifetime; with 1,000
workers a fixed period costs hundreds of requests a second that almost always answer the
same. A key whose answers stay the same is asked less and less often (the interval
doubles, up to a cap); any change, or an unhealthy answer, brings it back to the base
interval. The cost at rest is measured by ``benchmarks/bench_fleet.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["QuietSchedule"]

K = TypeVar("K", bound=Hashable)

_UNSEEN = object()


@dataclass(slots=True)
class _Slot:
    interval_s: float
    due: float
    last: object = _UNSEEN


class QuietSchedule(Generic[K]):
    """Per key: the next time it is due, and its last answer.

    Args:
        base_s: The interval after a change, an unhealthy answer, or for a new key.
        max_s: The longest interval a quiet key backs off to (at least ``base_s``).

    NOTE: a key never observed is due at once; an observed key is due ``interval_s``
    after its last observation.
    """

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s)
        self._slots: dict[K, _Slot] = {}

    def due(self, keys: Iterable[K], now: float) -> list[K]:
        """Those of ``keys`` due at ``now`` (new ones included), in the order given."""
        slots = self._slots
        return [k for k in keys if (s := slots.get(k)) is None or s.due <= now]

    def observed(self, key: K, answer: object, now: float, *, healthy: bool = True) -> None:
        """Record ``key``'s answer at ``now``: the same healthy answer as last time doubles
        its interval (up to ``max_s``); anything else resets it to ``base_s``."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(self.base_s, now)
        elif healthy and answer == slot.last:
            slot.interval_s = min(2 * slot.interval_s, self.max_s)
        else:
            slot.interval_s = self.base_s
        slot.last = answer if healthy else _UNSEEN
        slot.due = now + slot.interval_s

    def forget(self, key: K) -> None:
        """Stop tracking ``key`` (if asked again, it is due at once, at the base interval)."""
        self._slots.pop(key, None)
