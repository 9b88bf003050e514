"""The pooled-LRU bound: one LRU cache of the cluster's capacity, prefix semantics."""

from __future__ import annotations

import pytest

from router.cluster.trace_source import DEFAULT_TRACE_PATH
from router.sim.bounds import pooled_lru_hits
from router.sim.trace import ideal_hits, load_trace, to_requests
from tests.support.traces import rec


def test_an_infinite_pool_is_the_ideal_and_a_small_one_is_below_it() -> None:
    reqs = to_requests([rec(i, [0, 100 + i % 7, 200 + i % 5]) for i in range(60)])
    ideal = ideal_hits(reqs)
    assert pooled_lru_hits(reqs, 10_000 * 512) == ideal
    small = pooled_lru_hits(reqs, 6 * 512)
    assert (small.num_blocks, small.num_tokens) == (ideal.num_blocks, ideal.num_tokens)
    assert small.num_hit_blocks < ideal.num_hit_blocks


@pytest.mark.skipif(not DEFAULT_TRACE_PATH.is_file(), reason="optional Mooncake trace absent")
def test_the_mooncake_trace_on_one_pool_of_5859_blocks_is_the_published_figure() -> None:
    # The figure the trace's notes give: one global LRU cache of 5,859 blocks reaches 30.94 %.
    lru = pooled_lru_hits(load_trace(DEFAULT_TRACE_PATH), 5_859 * 512)
    assert round(lru.hit_rate_blocks, 4) == 0.3094
