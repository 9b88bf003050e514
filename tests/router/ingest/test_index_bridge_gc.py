"""The bridge's maps hold only ints, so CPython's cyclic garbage collector never tracks them.

A dict that holds a tracked object (a fresh tuple, a list) is tracked, and every
collection then walks all of its entries: with a million cached blocks that was 20-500 ms
per collection in the router process (bench_index). These tests fold every kind of event
(runs of new blocks, duplicates, CPU tier, removals that cascade, detached blocks,
branches) and
check that no map of the bridge is tracked afterwards.
"""

from __future__ import annotations

import gc

import pytest

from events.hashing import RouterKeyer
from events.schema import BlockRemoved, BlockStored
from router.index.changes import Changes
from router.ingest.bridge import WorkerBridge

BS = 4
TOKENS = list(range(1_000, 1_000 + 16 * BS))


def stored(first: int, count: int, parent: int | None, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=[500 + i for i in range(first, first + count)],
        parent_block_hash=parent,
        token_ids=TOKENS[first * BS : (first + count) * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def untracked(bridge: WorkerBridge) -> bool:
    return not any(gc.is_tracked(m) for m in (bridge._copies, bridge._keys, bridge._children))


def test_folding_every_kind_of_event_leaves_the_maps_untracked() -> None:
    bridge = WorkerBridge(RouterKeyer(), tolerate_orphans=True)
    changes = Changes()
    bridge.store(stored(0, 8, None), changes)  # a run of new blocks (bulk path)
    bridge.store(stored(8, 8, 507), changes)
    bridge.store(stored(0, 4, None), changes)  # duplicates (general path)
    bridge.store(stored(4, 4, 503, medium="CPU"), changes)  # another tier
    bridge.remove(BlockRemoved(block_hashes=[505, 504], medium="GPU"), changes)  # cascades
    bridge.store(stored(4, 2, 503), changes)  # re-cached: descendants indexed again
    bridge.store(stored(12, 2, 9_999), changes)  # unknown parent: detached
    branch = BlockStored(  # another continuation of block 3: the chain branches
        block_hashes=[900, 901],
        parent_block_hash=503,
        token_ids=list(range(7_000, 7_000 + 2 * BS)),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    bridge.store(branch, changes)
    bridge.remove(BlockRemoved(block_hashes=[503], medium="GPU"), changes)  # both unindexed
    assert max(bridge._children.values()) >= 1 << 63  # a packed branch
    assert bridge.entries()
    assert untracked(bridge)


@pytest.mark.slow
def test_a_large_bridge_survives_collections_untracked() -> None:
    bridge = WorkerBridge(RouterKeyer())
    tokens = list(range(4_096))
    for prompt in range(64):
        base = [(t * 31 + prompt) % 50_000 for t in tokens]
        event = BlockStored(
            block_hashes=[prompt * 10_000 + b for b in range(len(tokens) // BS)],
            parent_block_hash=None,
            token_ids=base,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        bridge.store(event, Changes())
        gc.collect(0)
    gc.collect()
    assert len(bridge._keys) == 64 * 1_024
    assert untracked(bridge)
