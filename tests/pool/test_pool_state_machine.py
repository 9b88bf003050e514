"""A Hypothesis state machine over KVCacheManager + BlockPool, checking pool invariants.

Requests over a 4-token alphabet with 2-token blocks share prefixes and duplicate hashes
often; the engine steps (admit, decode, finish, preempt), direct pool calls (allocate,
touch a cached block, free in any order), explicit evictions and resets interleave freely.
After every step the pool's accounting, its free queue and its cache map must agree, and
replaying the drained events into a multiset must give exactly the hashes the pool caches,
one per physical copy.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from events.extra_keys import LoraAdapter
from events.hashing import wire_hash
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pool.block import KVCacheBlock
from pool.errors import NoFreeBlocksError
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from pool.request import Request

pytestmark = pytest.mark.slow

NUM_BLOCKS = 13
BS = 2
TOKENS = st.integers(0, 3)
LORA = LoraAdapter(name="l", int_id=1, path="/adapters/l")
# Prompts that share prefixes, some an exact multiple of the block size (their last block
# is recomputed by the next identical prompt: a hash cached in two physical blocks).
PROMPTS = st.one_of(
    st.sampled_from([[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 0], [0, 1, 2, 2], [3, 3, 3, 3, 3, 3]]),
    st.lists(TOKENS, min_size=1, max_size=9),
)


def replay(events: list[KVCacheEvent], index: Counter[int]) -> None:
    """Apply events to a multiset of wire hashes, as a reference-counting consumer does."""
    for event in events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            for block_hash in event.block_hashes:
                assert isinstance(block_hash, int)
                index[block_hash] += 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                assert isinstance(block_hash, int)
                assert index[block_hash] > 0, "BlockRemoved of a hash that is not cached"
                index[block_hash] -= 1
                if not index[block_hash]:
                    del index[block_hash]
        else:
            assert isinstance(event, AllBlocksCleared)
            index.clear()


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, enable_kv_cache_events=True)
        )
        self.pool = self.manager.block_pool
        self.running: dict[str, Request] = {}
        self.replayed: Counter[int] = Counter()
        self.num_requests = 0
        # Blocks referenced directly through the pool API, as another owner would.
        self.held: list[KVCacheBlock] = []

    @rule(
        prompt=PROMPTS,
        lora=st.sampled_from([None, None, LORA]),
        cache_salt=st.sampled_from([None, None, "s"]),
    )
    def admit(self, prompt: list[int], lora: LoraAdapter | None, cache_salt: str | None) -> None:
        self.num_requests += 1
        request = self.manager.make_request(
            f"r{self.num_requests}", prompt, lora=lora, cache_salt=cache_salt
        )
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == len(hits) * BS <= request.num_tokens - 1
        assert [b.block_hash for b in hits] == request.block_hashes[: len(hits)]
        num_free = self.pool.get_num_free_blocks()
        new_blocks = self.manager.allocate_slots(
            request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
        )
        if new_blocks is None:
            assert self.pool.get_num_free_blocks() == num_free
            assert self.manager.get_block_ids(request.request_id) == []
            return
        request.num_computed_tokens = request.num_tokens
        self.running[request.request_id] = request

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=4).map(lambda t: t * 2))
    def admit_the_same_prompt_twice(self, prompt: list[int]) -> None:
        # An even length is a whole number of blocks: the second copy recomputes (and
        # caches again) the last block, unless the pool is full.
        self.admit(prompt, None, None)
        self.admit(prompt, None, None)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS)
    def decode(self, data: st.DataObject, token: int) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            self.manager.free(request)  # preempted
            del self.running[request.request_id]
        else:
            request.num_computed_tokens += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(request_id))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        # A request whose forward pass failed: its blocks nobody else holds leave the cache.
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        blocks = [self.pool.blocks[i] for i in self.manager.get_block_ids(request_id)]
        shared = {b.block_id: b.block_hash for b in blocks if b.ref_cnt > 1}
        self.manager.discard(self.running.pop(request_id))
        assert all(b.block_hash is None for b in blocks if b.block_id not in shared)
        assert {b.block_id: b.block_hash for b in blocks if b.block_id in shared} == shared

    @rule(num_blocks=st.integers(0, 3))
    def pool_get_new_blocks(self, num_blocks: int) -> None:
        num_free = self.pool.get_num_free_blocks()
        if num_blocks > num_free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(num_blocks)
            assert self.pool.get_num_free_blocks() == num_free
            return
        blocks = self.pool.get_new_blocks(num_blocks)
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
        self.held.extend(blocks)

    @precondition(lambda self: self.pool.cached_block_hash_to_block.num_blocks)
    @rule(data=st.data())
    def pool_touch_a_cached_block(self, data: st.DataObject) -> None:
        keys = sorted({key for key, _ in self.pool.cached_block_hash_to_block.items()})
        block = self.pool.get_cached_block(data.draw(st.sampled_from(keys)))
        assert block is not None
        self.pool.touch([block])
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def pool_free_blocks(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(range(len(self.held))))
        count = data.draw(st.integers(1, len(self.held)))
        chosen = [self.held[i] for i in order[:count]]
        self.held = [self.held[i] for i in sorted(order[count:])]
        self.pool.free_blocks(chosen)

    @rule(block_ids=st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3))
    def evict(self, block_ids: list[int]) -> None:
        self.pool.evict_blocks(block_ids)

    @precondition(lambda self: self.running or self.held)
    @rule()
    def free_everything_then_reset(self) -> None:
        for request in self.running.values():
            self.manager.free(request)
        self.running.clear()
        self.pool.free_blocks(self.held)
        self.held.clear()
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert self.manager.reset_prefix_cache() is True

    @precondition(lambda self: self.pool.cached_block_hash_to_block.num_blocks)
    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() is (not self.running and not self.held)

    @invariant()
    def free_plus_referenced_is_capacity(self) -> None:
        referenced = [b for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null]
        assert self.pool.get_num_free_blocks() + len(referenced) == NUM_BLOCKS - 1

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self) -> None:
        queued = self.pool.free_block_queue.get_all_free_blocks()
        assert len(queued) == self.pool.get_num_free_blocks()
        assert all(b.ref_cnt == 0 and not b.is_null for b in queued)
        expected = {b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null}
        assert sorted(b.block_id for b in queued) == sorted(expected)

    @invariant()
    def ref_counts_match_the_running_requests(self) -> None:
        held: Counter[int] = Counter()
        for request_id, request in self.running.items():
            block_ids = self.manager.get_block_ids(request_id)
            assert len(block_ids) == -(-request.num_computed_tokens // BS)
            held.update(block_ids)
        held.update(block.block_id for block in self.held)
        assert {b.block_id: b.ref_cnt for b in self.pool.blocks if b.ref_cnt} == dict(held)

    @invariant()
    def cache_map_and_block_hashes_agree(self) -> None:
        cache = self.pool.cached_block_hash_to_block
        filed = sorted((block.block_id, key) for key, block in cache.items())
        hashed = sorted((b.block_id, b.block_hash) for b in self.pool.blocks if b.block_hash)
        assert filed == hashed  # each cached block is filed under its own hash, once
        assert cache.num_blocks == len(hashed)
        for key, _ in cache.items():
            block = cache.get_one_block(key)
            assert block is not None and block.block_hash == key

    @invariant()
    def replayed_events_equal_the_cached_multiset(self) -> None:
        replay(self.pool.take_events(), self.replayed)
        cached = Counter(wire_hash(key) for key, _ in self.pool.cached_block_hash_to_block.items())
        assert self.replayed == cached

    @invariant()
    def stats_are_consistent(self) -> None:
        stats = self.manager.prefix_cache_stats
        assert 0 <= stats.hits <= stats.queries


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
