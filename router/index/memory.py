"""In-process ``PrefixIndex``: a dict of router keys to holders, for the simulator and tests.

It writes the same :class:`~router.index.changes.Changes` as the Redis index; only the
storage differs. Single-process and not shared between router replicas: no lease fences
its writes and they land at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from events.hashing import BlockKey
from events.identity import WorkerId
from router.index.base import IndexStats, PrefixMatch
from router.index.changes import CPU_MASK, GPU_MASK, Changes, masks_of

__all__ = ["MemoryPrefixIndex", "match_prefix"]


def match_prefix(
    masks_by_block: Iterable[Mapping[WorkerId, int]],
    workers: Sequence[WorkerId] | None,
) -> dict[WorkerId, PrefixMatch]:
    """Longest consecutive prefix per worker, given each block's holders and tier masks.

    Args:
        masks_by_block: For each of the request's blocks in order, worker -> tier mask
            (absent or 0: not held). Iteration may stop early; it is consumed lazily.
        workers: Candidates; ``None`` means every holder of block 0.

    Returns:
        A match per candidate that holds at least block 0.
    """
    alive: set[WorkerId] | None = None if workers is None else set(workers)
    gpu: dict[WorkerId, int] = {}
    cpu: dict[WorkerId, int] = {}
    for holders in masks_by_block:
        if alive is None:
            alive = {w for w, m in holders.items() if m}
        else:
            alive = {w for w in alive if holders.get(w, 0)}
        if not alive:
            break
        for worker in alive:
            if holders[worker] & GPU_MASK:
                gpu[worker] = gpu.get(worker, 0) + 1
            else:
                cpu[worker] = cpu.get(worker, 0) + 1
    matched = gpu.keys() | cpu.keys()
    return {
        w: PrefixMatch(gpu.get(w, 0) + cpu.get(w, 0), gpu.get(w, 0), cpu.get(w, 0)) for w in matched
    }


class MemoryPrefixIndex:
    """A ``PrefixIndex`` in Python dicts.

    NOTE: ``_holders[key][worker]`` is the tier mask of that worker's entry (never 0:
    empty entries and keys are deleted), and equals ``_entries[worker][key]``: the same
    entries by worker, so clearing one costs O(its entries).
    """

    def __init__(self) -> None:
        self._holders: dict[BlockKey, dict[WorkerId, int]] = {}
        self._entries: dict[WorkerId, dict[BlockKey, int]] = {}

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Nothing to fence in one process (see ``PrefixIndex.use_lease``)."""

    def forget_lease(self, worker_id: WorkerId) -> None:
        """Nothing to fence in one process (see ``PrefixIndex.forget_lease``)."""

    def changes_for(self, worker_id: WorkerId) -> Changes:
        """New changes (see ``PrefixIndex.changes_for``)."""
        return Changes()

    async def write(self, worker_id: WorkerId, changes: Changes) -> None:
        """Write one worker's changes (see ``PrefixIndex.write``)."""
        entries = self._entries.get(worker_id)
        if entries is None:
            entries = self._entries[worker_id] = {}
        for _, key, change in changes.items():
            new_mask = masks_of(change)[1]
            holders = self._holders.get(key)
            if new_mask:
                if holders is None:
                    holders = self._holders[key] = {}
                holders[worker_id] = entries[key] = new_mask
            elif holders is not None:
                holders.pop(worker_id, None)
                entries.pop(key, None)
                if not holders:
                    del self._holders[key]

    async def write_many(self, writes: Mapping[WorkerId, Changes]) -> dict[WorkerId, Exception]:
        """Write several workers' changes, one after the other; none fails (see
        ``PrefixIndex.write_many``)."""
        for worker_id, changes in writes.items():
            await self.write(worker_id, changes)
        return {}

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Nothing is queued (see ``PrefixIndex.flush``)."""

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Longest held prefix per candidate (see ``PrefixIndex.lookup``)."""
        empty: dict[WorkerId, int] = {}
        return match_prefix((self._holders.get(k, empty) for k in keys), workers)

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker; O(its entries)."""
        for key in self._entries.pop(worker_id, {}):
            holders = self._holders[key]
            del holders[worker_id]
            if not holders:
                del self._holders[key]

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker: router key -> tier mask (for checks)."""
        return dict(self._entries.get(worker_id, {}))

    async def stats(self) -> IndexStats:
        """Entries (key, worker, tier), distinct keys and workers with any entry."""
        num_entries = 0
        for holders in self._holders.values():
            for mask in holders.values():
                num_entries += (mask & GPU_MASK) + ((mask & CPU_MASK) >> 1)
        workers = {w for holders in self._holders.values() for w in holders}
        return IndexStats(num_entries, len(self._holders), len(workers))

    async def close(self) -> None:
        """Nothing runs in the background (see ``PrefixIndex.close``)."""
