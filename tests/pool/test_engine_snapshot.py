"""CachedChains: the snapshot runs rebuild exactly the cached set that the events imply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pool.snapshot import CachedChains

BS = 2


def _stored(hashes: list[int], parent: int | None, first_token: int = 0) -> BlockStored:
    tokens = [first_token + i for i in range(len(hashes) * BS)]
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


def _as_events(chains: CachedChains) -> list[KVCacheEvent]:
    return [
        _stored_run(run["block_hashes"], run["parent_block_hash"], run["token_ids"])
        for run in chains.runs()
    ]


def _stored_run(
    hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int]
) -> BlockStored:
    return BlockStored(list(hashes), parent, tokens, BS, None, "GPU", None)


def test_runs_split_at_branches_parents_first() -> None:
    chains = CachedChains(BS)
    chains.apply([_stored([1, 2, 3], None), _stored([4, 5], 2, 100), _stored([9], None, 50)])
    assert chains.runs() == [
        {"parent_block_hash": None, "block_hashes": [1, 2], "token_ids": [0, 1, 2, 3]},
        {"parent_block_hash": 2, "block_hashes": [3], "token_ids": [4, 5]},
        {"parent_block_hash": 2, "block_hashes": [4, 5], "token_ids": [100, 101, 102, 103]},
        {"parent_block_hash": None, "block_hashes": [9], "token_ids": [50, 51]},
    ]


def test_duplicates_are_reference_counted() -> None:
    chains = CachedChains(BS)
    chains.apply([_stored([1, 2], None), _stored([1, 2], None)])
    chains.apply([BlockRemoved([2], "GPU")])
    assert chains.block_hashes == {1, 2}
    chains.apply([BlockRemoved([2], "GPU"), BlockRemoved([7], "GPU")])
    assert chains.block_hashes == {1}


def test_orphans_keep_their_evicted_parent_and_clear_empties() -> None:
    chains = CachedChains(BS)
    chains.apply([_stored([1, 2, 3], None), BlockRemoved([2], "GPU")])
    assert chains.runs() == [
        {"parent_block_hash": None, "block_hashes": [1], "token_ids": [0, 1]},
        {"parent_block_hash": 2, "block_hashes": [3], "token_ids": [4, 5]},
    ]
    chains.apply([AllBlocksCleared()])
    assert (len(chains), chains.runs()) == (0, [])


@st.composite
def _histories(draw: st.DrawFn) -> list[KVCacheEvent]:
    """Stores that chain off random earlier blocks, interleaved with removals."""
    events: list[KVCacheEvent] = []
    known: list[int] = []
    next_hash = 1
    for _ in range(draw(st.integers(1, 25))):
        if known and draw(st.booleans()):
            events.append(BlockRemoved([draw(st.sampled_from(known))], "GPU"))
            continue
        parent = draw(st.none() | st.sampled_from(known)) if known else None
        size = draw(st.integers(1, 3))
        hashes = list(range(next_hash, next_hash + size))
        next_hash += size
        known.extend(hashes)
        events.append(_stored(hashes, parent, hashes[0] * 10))
    return events


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(_histories())
def test_replaying_the_runs_rebuilds_the_same_cache(events: list[KVCacheEvent]) -> None:
    chains = CachedChains(BS)
    chains.apply(events)
    rebuilt = CachedChains(BS)
    runs = chains.runs()
    seen: set[int | bytes | None] = {None}
    for run in runs:
        # Parents first: a run's parent is either earlier in the snapshot or not cached.
        parent = run["parent_block_hash"]
        assert parent in seen or parent not in chains
        seen.update(run["block_hashes"])
    rebuilt.apply(_as_events(chains))
    assert rebuilt.block_hashes == chains.block_hashes
    assert rebuilt.runs() == runs
    assert sum(len(run["block_hashes"]) for run in runs) == len(chains)
