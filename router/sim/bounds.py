"""The pooled-LRU bound: the prefix hits of one LRU cache with the whole cluster's capacity.

The infinite-cache ideal (:func:`router.sim.trace.ideal_hits`) is out of reach when a
trace's working set exceeds the cluster's memory. The fairer reference for a routing
policy is what perfect routing would give with the workers' own eviction: every request
finds every block any worker holds, and the cluster's blocks behave as one cache of their
total size that evicts the least recently used block, as a vLLM BlockPool does. A router
can beat it (by not spreading copies of one prefix, or by keeping one-off prompts from
evicting reused ones); one that loses against it misroutes.

Counting follows the other figures: a block hits only if it and every block before it in
its request are cached (a prefix cache cannot use a block after a miss); a request then
touches all its blocks, and the least recently used blocks are evicted beyond the
capacity. Within one request the tail counts as used before the head (vLLM frees a
request's blocks tail first), so a cached chain is evicted from its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.cluster.workload import TRACE_BLOCK_TOKENS, lru_prefix_depths
from router.sim.trace import IdealHits, SimRequest

__all__ = ["pooled_lru_hits"]


def pooled_lru_hits(requests: Sequence[SimRequest], capacity_tokens: int) -> IdealHits:
    """The pooled-LRU bound of a trace, counted on its own block ids.

    Args:
        requests: The trace, in arrival order.
        capacity_tokens: The cluster's KV cache capacity in tokens (workers x blocks x
            block size); the cache holds that many whole 512-token trace blocks.

    Returns:
        Hit blocks and tokens over all blocks and tokens, like the infinite-cache ideal.

    Raises:
        WorkloadError: The capacity holds no trace block.
    """
    depths = lru_prefix_depths(
        (r.hash_ids for r in requests), capacity_tokens // TRACE_BLOCK_TOKENS
    )
    hit_blocks = hit_tokens = blocks = tokens = 0
    for r, depth in zip(requests, depths, strict=True):
        hit_blocks += depth
        hit_tokens += min(depth * TRACE_BLOCK_TOKENS, r.num_prompt_tokens)
        blocks += len(r.hash_ids)
        tokens += r.num_prompt_tokens
    return IdealHits(blocks, hit_blocks, tokens, hit_tokens)
