"""The bridged index: each worker's bridge in front of a store, kept, reset and dropped with
the worker's entries and lease."""

from __future__ import annotations

import asyncio

from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import BlockStored, KVEventBatch
from router.index.memory import MemoryPrefixIndex
from router.ingest.bridged_index import BridgedIndex

W = WorkerId("w")
TOKENS = list(range(8))


def stored(hashes: list[int], block_size: int = 4) -> KVEventBatch:
    tokens = TOKENS[: block_size * len(hashes)]
    event = BlockStored(hashes, None, tokens, block_size, None, "GPU", None)
    return KVEventBatch(1.0, [event])


def test_the_bridge_goes_with_the_lease_unless_kept_for_a_rewrite() -> None:
    async def main() -> None:
        index = BridgedIndex(MemoryPrefixIndex(), RouterKeyer(3))
        await index.apply(W, stored([1, 2]))
        entries = index.bridge(W).entries()
        assert len(entries) == 2
        index.forget_lease(W, keep_bridge=True)
        assert index.bridge(W).entries() == entries
        index.forget_lease(W)
        assert index.bridge(W).entries() == {}  # a new, empty bridge

    asyncio.run(main())


def test_clearing_through_the_index_resets_the_bridge() -> None:
    async def main() -> None:
        index = BridgedIndex(MemoryPrefixIndex())
        await index.apply(W, stored([1, 2]))
        await index.clear_worker(W)
        assert index.bridge(W).entries() == {}
        assert await index.worker_entries(W) == {}
        assert await index.rewrite_worker(W) == 0

    asyncio.run(main())


def test_the_expected_block_size_holds_for_bridges_made_and_adopted_later() -> None:
    async def main() -> None:
        index = BridgedIndex(MemoryPrefixIndex())
        index.expect_block_size(W, 4)
        await index.apply(W, stored([1], block_size=2))  # skipped whole, counted
        assert index.bridge(W).counters.block_size_mismatch == 1
        adopted = BridgedIndex(MemoryPrefixIndex()).bridge(W)
        index.adopt_bridge(W, adopted)
        assert index.bridge(W) is adopted and adopted.block_size == 4
        index.expect_block_size(W, 0)
        assert adopted.block_size == 0

    asyncio.run(main())
