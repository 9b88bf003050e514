"""The pooled-LRU bound's cache: prefix hits on one LRU cache, on trace ids or router keys."""

from __future__ import annotations

import pytest

from events.hashing import root_key, router_block_keys
from router.cluster.workload import WorkloadError, lru_prefix_depths, pooled_lru_hit_tokens


def test_a_block_hits_only_after_its_whole_prefix_and_the_tail_is_evicted_first() -> None:
    depths = lru_prefix_depths([[1, 2, 3], [1, 2, 4], [7, 8], [1, 2], [4]], capacity_blocks=4)
    # Oldest first: [1,2,3] leaves 3 2 1 (its tail oldest); [1,2,4] hits 1, 2 and leaves
    # 3 4 2 1; [7,8] evicts 3 and 4, leaving 2 1 8 7; [1,2] hits both; [4] misses.
    assert depths == [0, 2, 0, 2, 0]


def test_a_miss_ends_the_prefix_even_if_later_blocks_are_cached() -> None:
    assert lru_prefix_depths([[1, 2], [3, 2], [1, 2]], capacity_blocks=8) == [0, 0, 2]


def test_capacity_must_hold_a_block() -> None:
    with pytest.raises(WorkloadError, match="at least 1 block"):
        lru_prefix_depths([[1]], capacity_blocks=0)


def test_the_token_bound_keys_prompts_as_the_router_does() -> None:
    bs = 4
    a, b, c = list(range(8)), list(range(8)) + [9] * 4, list(range(50, 58))
    # Capacity 3 blocks: b hits a's 2 blocks and adds one; c evicts two, tail first (b's
    # third block, then a's second), so a finds its first block again: 2 + 1 blocks hit.
    assert pooled_lru_hit_tokens([a, b, c, a], bs, 3) == (2 + 1) * bs
    keys = [router_block_keys(p, bs, root_key()) for p in (a, b, c, a)]
    assert lru_prefix_depths(keys, 3) == [0, 2, 0, 1]
