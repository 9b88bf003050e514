"""In-process ``PrefixIndex``: a dict of router keys to holders, for the simulator and tests.

It shares the engine-hash bridge (:mod:`router.ingest.bridge`) with the Redis index, so
both fold events identically; only the storage differs. Single-process and not shared
between router replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.schema import KVEventBatch
from router.index.base import IndexStats, PrefixMatch
from router.index.changes import CPU_MASK, GPU_MASK, Changes, masks_of
from router.ingest.bridge import WorkerBridge, fold_batch

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
    """A ``PrefixIndex`` in a Python dict.

    Args:
        keyer: Router key function (its seed must match the one requests are keyed with).

    NOTE: ``_holders[key][worker]`` is the tier mask of that worker's entry (never 0:
    empty entries and keys are deleted), and equals its bridge's mask for the key.
    """

    def __init__(self, keyer: RouterKeyer | None = None) -> None:
        self.keyer = keyer if keyer is not None else RouterKeyer()
        self._holders: dict[BlockKey, dict[WorkerId, int]] = {}
        self._bridges: dict[WorkerId, WorkerBridge] = {}

    def bridge(self, worker_id: WorkerId) -> WorkerBridge:
        """The engine-hash bridge of a worker (created on first use)."""
        found = self._bridges.get(worker_id)
        if found is None:
            found = self._bridges[worker_id] = WorkerBridge(self.keyer)
        return found

    async def apply(self, worker_id: WorkerId, batch: KVEventBatch) -> None:
        """Apply one worker's event batch (see ``PrefixIndex.apply``)."""

        async def write(changes: Changes) -> None:
            self._write(worker_id, changes)

        async def clear() -> None:
            await self.clear_worker(worker_id)

        await fold_batch(worker_id, self.bridge(worker_id), batch, write, clear)

    def _write(self, worker_id: WorkerId, changes: Changes) -> None:
        for _, key, change in changes.items():
            new_mask = masks_of(change)[1]
            holders = self._holders.get(key)
            if new_mask:
                if holders is None:
                    holders = self._holders[key] = {}
                holders[worker_id] = new_mask
            elif holders is not None:
                holders.pop(worker_id, None)
                if not holders:
                    del self._holders[key]

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Longest held prefix per candidate (see ``PrefixIndex.lookup``)."""
        empty: dict[WorkerId, int] = {}
        return match_prefix((self._holders.get(k, empty) for k in keys), workers)

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker and reset its bridge; O(its entries)."""
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            self._write(worker_id, bridge.reset())

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker: router key -> tier mask (for checks)."""
        bridge = self._bridges.get(worker_id)
        if bridge is None:
            return {}
        return {key: mask for key, (_, mask) in bridge.entries().items()}

    async def stats(self) -> IndexStats:
        """Entries (key, worker, tier), distinct keys and workers with any entry."""
        num_entries = 0
        for holders in self._holders.values():
            for mask in holders.values():
                num_entries += (mask & GPU_MASK) + ((mask & CPU_MASK) >> 1)
        workers = {w for holders in self._holders.values() for w in holders}
        return IndexStats(num_entries, len(self._holders), len(workers))
