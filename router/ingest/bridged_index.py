"""A prefix index fed with KV events: one engine-hash bridge per worker in front of a store.

The store (any :class:`~router.index.base.PrefixIndex`) writes router-key changes and
knows nothing of engine hashes; :class:`BridgedIndex` keeps each worker's
:class:`~router.ingest.bridge.WorkerBridge`, folds the worker's batches through it
(:func:`~router.ingest.bridge.fold_batch`) and hands the changes to the store.

Invariant: a worker's bridge describes exactly the entries the store holds for it: the
bridge is reset whenever the store clears the worker through it, and dropped with its
lease (a bridge handed over with a lease is adopted whole, see
:meth:`BridgedIndex.adopt_bridge`). Where the store lost entries behind the bridge's back
(Redis restarted empty), :meth:`BridgedIndex.rewrite_worker` writes them again. The
bridges live in this process; after a restart, resync rebuilds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.schema import KVEventBatch
from router.index.base import IndexStats, PrefixIndex, PrefixMatch
from router.index.changes import Changes
from router.ingest.bridge import WorkerBridge, fold_batch

__all__ = ["BridgedIndex"]

_Sink = tuple[
    Callable[[Changes], Awaitable[None]], Callable[[], Awaitable[None]], Callable[[], Changes]
]
"""``fold_batch``'s write, clear and into callbacks for one worker."""


class BridgedIndex:
    """A ``PrefixIndex`` store with the workers' engine-hash bridges in front.

    Args:
        store: Where the entries are written and looked up.
        keyer: Router key function (its seed must match the one requests are keyed with).
    """

    def __init__(self, store: PrefixIndex, keyer: RouterKeyer | None = None) -> None:
        self.store = store
        self.keyer = keyer if keyer is not None else RouterKeyer()
        self._bridges: dict[WorkerId, WorkerBridge] = {}
        self._block_sizes: dict[WorkerId, int] = {}
        self._sinks: dict[WorkerId, _Sink] = {}

    def bridge(self, worker_id: WorkerId) -> WorkerBridge:
        """The engine-hash bridge of a worker (created on first use)."""
        found = self._bridges.get(worker_id)
        if found is None:
            block_size = self._block_sizes.get(worker_id, 0)
            found = self._bridges[worker_id] = WorkerBridge(self.keyer, block_size=block_size)
        return found

    def adopt_bridge(self, worker_id: WorkerId, bridge: WorkerBridge) -> None:
        """Make ``bridge`` the worker's (one handed over with its lease, matching the
        worker's entries in the store)."""
        bridge.block_size = self._block_sizes.get(worker_id, 0)
        self._bridges[worker_id] = bridge

    def expect_block_size(self, worker_id: WorkerId, block_size: int) -> None:
        """Skip (and count in the worker's bridge) every ``BlockStored`` of the worker
        whose block size is not ``block_size`` (its registered one; 0: any, forgotten)."""
        if block_size:
            self._block_sizes[worker_id] = block_size
        else:
            self._block_sizes.pop(worker_id, None)
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            bridge.block_size = block_size

    async def apply(self, worker_id: WorkerId, batch: KVEventBatch) -> None:
        """Apply one worker's event batch: fold it through the worker's bridge into
        changes the store writes.

        Raises:
            OrphanParentError: A ``BlockStored`` names a parent the worker's bridge has
                never seen; the events before it in the batch are applied, the rest are
                not. The caller replays or resyncs the worker.
            StaleLeaseError: The store no longer writes for the worker (lease lost).
            PrefixIndexError: No lease token was given to the store for the worker.
        """
        sink = self._sinks.get(worker_id)
        if sink is None:
            sink = self._sinks[worker_id] = self._sink(worker_id)
        await fold_batch(worker_id, self.bridge(worker_id), batch, *sink)

    def _sink(self, worker_id: WorkerId) -> _Sink:
        """What ``fold_batch`` writes the worker's segments with (made once per worker:
        the ingest's hot path allocates no closures per batch)."""
        store = self.store

        async def write(changes: Changes) -> None:
            await store.write(worker_id, changes)

        async def clear() -> None:
            await self.clear_worker(worker_id)

        def into() -> Changes:  # read with write's test, no await between the two
            return store.changes_for(worker_id)

        return write, clear, into

    async def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of one worker from the store and reset its bridge.

        Raises:
            StaleLeaseError: The store no longer writes for the worker (lease lost).
        """
        await self.store.clear_worker(worker_id)
        bridge = self._bridges.get(worker_id)
        if bridge is not None:
            bridge.reset()

    def use_lease(self, worker_id: WorkerId, token: str) -> None:
        """Write the worker's entries under this lease token (see ``PrefixIndex.use_lease``)."""
        self.store.use_lease(worker_id, token)

    def forget_lease(self, worker_id: WorkerId, *, keep_bridge: bool = False) -> None:
        """Stop writing for the worker: its lease and queued writes go, and (unless
        ``keep_bridge``: for :meth:`rewrite_worker` under a new lease) its bridge."""
        self.store.forget_lease(worker_id)
        if not keep_bridge:
            self._bridges.pop(worker_id, None)
        self._sinks.pop(worker_id, None)

    async def rewrite_worker(self, worker_id: WorkerId) -> int:
        """Write one worker's entries again from its bridge, which still holds them all,
        after the store lost some or all of them (Redis restarted empty, a shard lost its
        data).

        What the store holds of the worker is dropped first, so its entries end exactly
        the bridge's.

        Returns:
            The number of entries written.

        Raises:
            StaleLeaseError: The store no longer writes for the worker (lease lost).
        """
        store = self.store
        await store.clear_worker(worker_id)
        entries = self.bridge(worker_id).entries()
        changes = store.changes_for(worker_id)
        for key, (tag, mask) in entries.items():
            changes.note(tag, key, 0, mask)
        await store.write(worker_id, changes)
        await store.flush(worker_id)
        return len(entries)

    async def flush(self, worker_id: WorkerId | None = None) -> None:
        """Wait for the queued writes of a worker (or all; see ``PrefixIndex.flush``)."""
        await self.store.flush(worker_id)

    async def lookup(
        self, keys: Sequence[BlockKey], workers: Sequence[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]:
        """Longest held prefix per candidate (see ``PrefixIndex.lookup``)."""
        return await self.store.lookup(keys, workers)

    async def worker_entries(self, worker_id: WorkerId) -> dict[BlockKey, int]:
        """Every entry of one worker in the store: router key -> tier mask (for checks)."""
        return await self.store.worker_entries(worker_id)

    async def stats(self) -> IndexStats:
        """Current sizes of the store's index."""
        return await self.store.stats()

    async def close(self) -> None:
        """Stop the store's background writers (queued writes are dropped)."""
        await self.store.close()
