"""Contract of ``PrefixIndex``: the same suite over memory, Redis and Redis Cluster, and
memory and Redis wrapped in group commit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest

from events.extra_keys import LoraAdapter
from events.hashing import RouterKeyer
from events.identity import WorkerId
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, WireHash
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager
from router.errors import OrphanParentError
from router.index.base import IndexStats, PrefixMatch
from router.index.changes import CPU_MASK, GPU_MASK
from tests.support.index_env import IndexEnv, OpenIndex

BS = 4
KEYER = RouterKeyer()
W1, W2, W3 = WorkerId("w1"), WorkerId("w2"), WorkerId("w3")
TOKENS = list(range(100, 132))  # 8 blocks of 4
KEYS = KEYER.keys(TOKENS, BS)


def stored(
    hashes: Sequence[WireHash],
    parent: WireHash | None,
    first_block: int,
    medium: str | None = "GPU",
    tokens: Sequence[int] = TOKENS,
    lora_name: str | None = None,
    extra_keys: list[object] | None = None,
) -> BlockStored:
    """A BlockStored of consecutive blocks of ``tokens`` starting at ``first_block``."""
    start = first_block * BS
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens[start : start + BS * len(hashes)]),
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
    )


def removed(hashes: Sequence[WireHash], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))


def run(open_index: OpenIndex, body: Callable[[IndexEnv], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_index() as env:
            for worker in (W1, W2, W3):
                await env.prepare(worker)
            await body(env)

    asyncio.run(main())


def m(gpu: int, cpu: int = 0) -> PrefixMatch:
    return PrefixMatch(gpu + cpu, gpu, cpu)


def test_chain_lookup_all_and_candidates(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2, 3], None, 0), stored([4, 5], 3, 3)))
        await idx.apply(W2, batch(stored([11, 12], None, 0)))
        assert await idx.lookup(KEYS) == {W1: m(5), W2: m(2)}
        assert await idx.lookup(KEYS, [W2]) == {W2: m(2)}
        assert await idx.lookup(KEYS, [W3]) == {}
        assert await idx.lookup(KEYS[:1], [W1, W2, W3]) == {W1: m(1), W2: m(1)}
        assert await idx.lookup([], [W1]) == {}
        assert await idx.lookup(KEYS, []) == {}
        # Another prompt sharing block 0 only.
        other = KEYER.keys(TOKENS[:4] + [7] * 28, BS)
        assert await idx.lookup(other) == {W1: m(1), W2: m(1)}

    run(open_index, body)


def test_a_store_writes_router_key_changes(open_index: OpenIndex) -> None:
    """The store itself takes changes of router-key entries: no engine hash, no bridge."""

    async def body(env: IndexEnv) -> None:
        store = env.index.store
        changes = store.changes_for(W1)
        changes.add_new(KEYS[0], KEYS[:3], GPU_MASK)
        await store.write(W1, changes)
        await env.settle()
        assert await store.lookup(KEYS) == {W1: m(3)}
        changes = store.changes_for(W1)
        changes.note(KEYS[0], KEYS[1], GPU_MASK, GPU_MASK | CPU_MASK)
        changes.note(KEYS[0], KEYS[2], GPU_MASK, CPU_MASK)
        await store.write(W1, changes)
        await env.settle()
        assert await store.worker_entries(W1) == {KEYS[0]: 1, KEYS[1]: 3, KEYS[2]: 2}
        assert await store.lookup(KEYS) == {W1: m(2, 1)}
        await store.clear_worker(W1)
        assert await store.lookup(KEYS) == {}

    run(open_index, body)


def test_a_store_writes_several_workers_at_once(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        store = env.index.store
        writes = {worker: store.changes_for(worker) for worker in (W1, W2)}
        writes[W1].add_new(KEYS[0], KEYS[:3], GPU_MASK)
        writes[W2].add_new(KEYS[0], KEYS[:1], CPU_MASK)
        assert await store.write_many(writes) == {}
        await env.settle()
        assert await store.lookup(KEYS) == {W1: m(3), W2: m(0, 1)}

    run(open_index, body)


def test_entries_the_store_lost_are_written_again_from_the_bridge(
    open_index: OpenIndex,
) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2, 3], None, 0), stored([4], 3, 3, medium="CPU")))
        await idx.apply(W2, batch(stored([1, 2], None, 0)))
        await env.settle()
        held = await idx.worker_entries(W1)
        await idx.store.clear_worker(W1)  # lost behind the bridge's back
        assert await idx.lookup(KEYS) == {W2: m(2)}
        assert await idx.rewrite_worker(W1) == len(held) == 4
        assert await idx.worker_entries(W1) == held
        assert await idx.lookup(KEYS) == {W1: m(3, 1), W2: m(2)}
        await idx.apply(W1, batch(removed([2])))  # the bridge goes on from there
        await env.settle()
        assert await idx.lookup(KEYS) == {W1: m(1), W2: m(2)}

    run(open_index, body)


def test_removal_cuts_the_prefix_and_duplicates_are_refcounted(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2, 3, 4], None, 0)))
        await idx.apply(W1, batch(stored([4], 3, 3)))  # a second physical copy of block 3
        await idx.apply(W1, batch(removed([4])))
        assert await idx.lookup(KEYS) == {W1: m(4)}
        await idx.apply(W1, batch(removed([4])))
        assert await idx.lookup(KEYS) == {W1: m(3)}
        await idx.apply(W1, batch(removed([2])))
        assert await idx.lookup(KEYS) == {W1: m(1)}
        await idx.apply(W1, batch(removed([99, 2])))  # unknown and already-removed copies
        assert await idx.lookup(KEYS) == {W1: m(1)}
        # Block 2 stays cached behind the gap but is not indexed (prefix closure) ...
        assert await idx.stats() == _stats(entries=1, keys=1, workers=1)
        assert await idx.worker_entries(W1) == {KEYS[0]: 1}
        # ... until block 1 is cached again: then both are indexed again.
        await idx.apply(W1, batch(stored([2], 1, 1)))
        assert await idx.lookup(KEYS) == {W1: m(3)}
        assert await idx.worker_entries(W1) == {KEYS[0]: 1, KEYS[1]: 1, KEYS[2]: 1}

    run(open_index, body)


def test_tiers_split_gpu_and_cpu(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2], None, 0), stored([3, 4], 2, 2, medium="CPU")))
        await idx.apply(W1, batch(stored([2], 1, 1, medium="CPU")))  # offloaded copy
        assert await idx.lookup(KEYS) == {W1: m(2, 2)}
        await idx.apply(W1, batch(removed([2], medium="GPU")))
        assert await idx.lookup(KEYS) == {W1: m(1, 3)}
        await idx.apply(W2, batch(stored([1], None, 0, medium=None)))  # unspecified = GPU
        assert await idx.lookup(KEYS, [W2]) == {W2: m(1)}
        assert await idx.stats() == _stats(entries=5, keys=4, workers=2)

    run(open_index, body)


def test_all_blocks_cleared_and_clear_worker(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2, 3], None, 0)))
        await idx.apply(W2, batch(stored([1, 2], None, 0)))
        await idx.apply(W1, batch(AllBlocksCleared(), stored([7], None, 0)))
        assert await idx.lookup(KEYS) == {W1: m(1), W2: m(2)}
        await idx.clear_worker(W2)
        assert await idx.lookup(KEYS) == {W1: m(1)}
        # The cleared worker's old hashes are forgotten: its parent 2 is now unknown.
        with pytest.raises(OrphanParentError):
            await idx.apply(W2, batch(stored([3], 2, 2)))
        assert await idx.stats() == _stats(entries=1, keys=1, workers=1)

    run(open_index, body)


@pytest.mark.slow
def test_a_worker_of_thousands_of_families_is_cleared(open_index: OpenIndex) -> None:
    """A clear fans out over the worker's families (per shard on a cluster): bounded, so a
    worker holding far more families than a connection pool has connections is cleared."""

    async def body(env: IndexEnv) -> None:
        idx = env.index
        roots = [
            stored([10_000 + i], None, 0, tokens=[i, i + 1, i + 2, i + 3]) for i in range(2_000)
        ]
        await idx.apply(W1, batch(*roots))
        await idx.apply(W2, batch(stored([1, 2], None, 0)))
        assert (await idx.stats()).num_entries == 2_002
        await idx.clear_worker(W1)
        assert await idx.worker_entries(W1) == {}
        assert await idx.stats() == _stats(entries=2, keys=2, workers=1)
        assert await idx.lookup(KEYS) == {W2: m(2)}

    run(open_index, body)


def test_orphan_parent_applies_the_events_before_it(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        with pytest.raises(OrphanParentError) as info:
            await idx.apply(
                W1, batch(stored([1, 2], None, 0), stored([4], 333, 3), stored([3], 2, 2))
            )
        assert (info.value.worker_id, info.value.parent_hash, info.value.num_applied) == (
            W1,
            333,
            1,
        )
        assert await idx.lookup(KEYS) == {W1: m(2)}

    run(open_index, body)


def test_malformed_events_never_corrupt(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2], None, 0)))
        bad_count = BlockStored([3, 4], 2, [1, 2, 3], BS, None, "GPU", None)
        bad_token = BlockStored([3], 2, [1, 2, -3, 4], BS, None, "GPU", None)
        bad_size = BlockStored([3], 2, [], 0, None, "GPU", None)
        no_blocks = BlockStored([], 2, [], BS, None, "GPU", None)
        await idx.apply(W1, batch(bad_count, bad_token, bad_size, no_blocks, stored([3], 2, 2)))
        assert await idx.lookup(KEYS) == {W1: m(3)}
        assert await idx.stats() == _stats(entries=3, keys=3, workers=1)

    run(open_index, body)


def test_lora_and_salt_get_their_own_keys(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(stored([1, 2], None, 0, lora_name="ad1", extra_keys=[["ad1"]])))
        await idx.apply(W2, batch(stored([1, 2], None, 0, extra_keys=[["tenant-a"], None])))
        assert await idx.lookup(KEYS) == {}
        lora_keys = KEYER.keys(TOKENS, BS, lora_name="ad1")
        salt_keys = KEYER.keys(TOKENS, BS, cache_salt="tenant-a")
        assert await idx.lookup(lora_keys) == {W1: m(2)}
        assert await idx.lookup(salt_keys) == {W2: m(2)}

    run(open_index, body)


SQL = LoraAdapter(name="sql", int_id=2, path="/adapters/sql")


@pytest.mark.parametrize(
    ("lora", "salt"),
    [
        (SQL, None),
        (None, "tenant-a"),
        (SQL, "tenant-a"),
        (SQL, "sql"),  # a salt equal to the LoRA name is still a salt
        (None, ""),  # an empty salt is no salt, for the engine and the router alike
    ],
)
def test_worker_events_of_lora_and_salted_requests_meet_their_request_keys(
    open_index: OpenIndex, lora: LoraAdapter | None, salt: str | None
) -> None:
    """The events a kvroute worker's KV cache manager publishes for a request land on
    the keys the router computes for that request from its tokens, LoRA name and salt."""
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=16, block_size=BS, enable_kv_cache_events=True)
    )
    request = manager.make_request("r", TOKENS[:21], lora=lora, cache_salt=salt)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    events = manager.take_events()

    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, KVEventBatch(ts=1.0, events=events))
        lora_name = None if lora is None else lora.name
        keys = KEYER.keys(TOKENS, BS, lora_name=lora_name, cache_salt=salt)
        assert await idx.lookup(keys) == {W1: m(5)}
        assert await idx.lookup(KEYS) == ({W1: m(5)} if lora is None and not salt else {})

    run(open_index, body)


def test_bytes_hashes_and_mixed_workers(open_index: OpenIndex) -> None:
    async def body(env: IndexEnv) -> None:
        idx = env.index
        h = [bytes([i]) * 32 for i in range(3)]
        await idx.apply(W3, batch(stored(h[:2], None, 0), stored(h[2:], h[1], 2)))
        assert await idx.worker_entries(W3) == {KEYS[0]: 1, KEYS[1]: 1, KEYS[2]: 1}
        await idx.apply(W3, batch(removed([h[0]])))
        assert await idx.lookup(KEYS) == {}
        assert await idx.lookup(KEYS, [W3]) == {}
        assert await idx.worker_entries(W3) == {}

    run(open_index, body)


def _stats(entries: int, keys: int, workers: int) -> IndexStats:
    return IndexStats(entries, keys, workers, _UnknownOrPositive())  # type: ignore[arg-type]


class _UnknownOrPositive:
    """Equal to None or any positive int: a store that knows its memory use (a server's
    ``used_memory``) reports it, and it is no fixed number."""

    def __eq__(self, other: object) -> bool:
        return other is None or (isinstance(other, int) and other > 0)

    __hash__ = None  # type: ignore[assignment]


def test_long_chains_across_lookup_windows(open_index: OpenIndex) -> None:
    # The Redis lookup checks growing windows of blocks (32, 128, ...): cut at and
    # around their edges, on both tiers.
    long_tokens = list(range(5_000, 5_000 + 200 * BS))
    long_keys = KEYER.keys(long_tokens, BS)

    def chain(count: int, start: int = 0, medium: str = "GPU") -> BlockStored:
        parent = None if start == 0 else 10_000 + start - 1
        return stored(
            [10_000 + i for i in range(start, start + count)], parent, start, medium, long_tokens
        )

    async def body(env: IndexEnv) -> None:
        idx = env.index
        await idx.apply(W1, batch(chain(100), removed([10_070])))
        await idx.apply(W2, batch(chain(32)))
        await idx.apply(W3, batch(chain(32), chain(130, 32, medium="CPU")))
        assert await idx.lookup(long_keys) == {W1: m(70), W2: m(32), W3: m(32, 130)}
        assert await idx.lookup(long_keys[:33], [W3]) == {W3: m(32, 1)}
        await idx.apply(W3, batch(removed([10_000 + 160], medium="CPU")))
        assert await idx.lookup(long_keys, [W3, W2]) == {W3: m(32, 128), W2: m(32)}

    run(open_index, body)
