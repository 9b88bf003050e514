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

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from events.hashing import root_key, router_block_keys
from router.cluster.workload import TRACE_BLOCK_TOKENS
from router.sim.trace import IdealHits, SimError, SimRequest

__all__ = ["lru_prefix_depths", "pooled_lru_hit_tokens", "pooled_lru_hits"]


def lru_prefix_depths(requests: Iterable[Sequence[Hashable]], capacity_blocks: int) -> list[int]:
    """Per request, its prefix hit in blocks on one LRU cache of ``capacity_blocks``.

    Args:
        requests: Each request's block ids from block 0, in arrival order (an id names the
            block together with its whole prefix, as trace ids and router keys do).
        capacity_blocks: Blocks the cache holds; at least 1.

    Returns:
        One depth per request: how many of its leading blocks were cached on arrival.

    Raises:
        SimError: ``capacity_blocks`` is below 1.
    """
    if capacity_blocks < 1:
        raise SimError(f"a pooled LRU cache needs at least 1 block, got {capacity_blocks}")
    cache: OrderedDict[Hashable, None] = OrderedDict()
    depths: list[int] = []
    for blocks in requests:
        depth = 0
        for block in blocks:
            if block not in cache:
                break
            depth += 1
        depths.append(depth)
        # Touched last to first: a request's tail becomes older than its head, as vLLM
        # frees a finished request's blocks tail first, so a chain is evicted from its end.
        for block in reversed(blocks):
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return depths


def pooled_lru_hits(requests: Sequence[SimRequest], capacity_tokens: int) -> IdealHits:
    """The pooled-LRU bound of a trace, counted on its own block ids.

    Args:
        requests: The trace, in arrival order.
        capacity_tokens: The cluster's KV cache capacity in tokens (workers x blocks x
            block size); the cache holds that many whole 512-token trace blocks.

    Returns:
        Hit blocks and tokens over all blocks and tokens, like the infinite-cache ideal.

    Raises:
        SimError: The capacity holds no trace block.
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


def pooled_lru_hit_tokens(
    prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int
) -> int:
    """Prompt tokens one LRU prefix cache of ``capacity_blocks`` blocks would serve.

    The counterpart of :func:`router.cluster.workload.ideal_hit_tokens` for a finite cache:
    prompts are keyed in blocks of ``block_size`` as the router keys them.

    Args:
        prompts: Prompts in arrival order.
        block_size: Tokens per cache block.
        capacity_blocks: The cluster's blocks (workers x blocks per worker).

    Raises:
        SimError: ``capacity_blocks`` is below 1.
    """
    root = root_key()
    chains = (router_block_keys(prompt, block_size, root) for prompt in prompts)
    return sum(lru_prefix_depths(chains, capacity_blocks)) * block_size
