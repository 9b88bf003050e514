"""BlockPool: null block, FIFO allocation, free-queue order, lazy eviction, reset rules."""

from __future__ import annotations

import pytest

from events.extra_keys import LoraAdapter
from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from pool.block import KVCacheBlock
from pool.block_pool import BlockPool
from pool.errors import NoFreeBlocksError, PoolError
from pool.request import BlockHasher, Request

BS = 4


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def block_ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_null_block_is_never_handed_out_or_counted() -> None:
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert block_ids(blocks) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    pool.touch([pool.null_block])  # a placeholder reference: it never leaves or joins the queue
    assert (pool.null_block.ref_cnt, pool.get_num_free_blocks()) == (1, 0)
    pool.free_blocks([pool.null_block, *blocks])
    assert free_ids(pool) == [1, 2, 3, 4]  # never cached: to the head, in the order freed
    assert pool.null_block.ref_cnt == 0
    assert BlockPool(1).get_usage() == 0.0


def test_get_new_blocks_is_fifo_with_ref_count_one_and_raises_when_short() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(2)
    assert block_ids(first) == [1, 2]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.get_usage() == 0.4
    with pytest.raises(NoFreeBlocksError, match="cannot get 4 free blocks: 3 are free") as err:
        pool.get_new_blocks(4)
    assert isinstance(err.value, ValueError) and isinstance(err.value, PoolError)
    assert free_ids(pool) == [3, 4, 5]  # a failed call changes nothing
    assert pool.get_new_blocks(0) == []


def test_free_queue_order_after_frees_cached_to_tail_uncached_to_head() -> None:
    pool = BlockPool(7, enable_kv_cache_events=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    request = Request("r", range(8), BlockHasher(BS))
    pool.cache_full_blocks(request, [b1, b3], 0, 2, BS)
    assert free_ids(pool) == [5, 6]
    pool.free_blocks([b4, b3, b2, b1])
    assert free_ids(pool) == [4, 2, 5, 6, 3, 1]
    assert [b.ref_cnt for b in (b1, b2, b3, b4)] == [0, 0, 0, 0]


def test_shared_block_is_freed_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert (block.ref_cnt, free_ids(pool)) == (1, [2, 3])
    pool.free_blocks([block])
    assert (block.ref_cnt, free_ids(pool)) == (0, [1, 2, 3])


def test_eviction_order_and_removed_events_are_lazy() -> None:
    pool = BlockPool(5, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4)
    request = Request("r", range(16), BlockHasher(BS))
    digests = hash_blocks_sha256_cbor(list(range(16)), BS)
    pool.cache_full_blocks(request, blocks, 0, 4, BS)
    pool.take_events()
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert pool.take_events() == []  # freeing emits nothing; the blocks stay findable
    assert pool.get_cached_block(digests[0]) is blocks[0]
    assert block_ids(pool.get_new_blocks(3)) == [4, 3, 2]
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[wire_hash(digests[i])], medium="GPU", group_idx=0)
        for i in (3, 2, 1)
    ]
    assert [pool.get_cached_block(d) for d in digests] == [blocks[0], None, None, None]


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    request = Request("r", range(8), BlockHasher(BS))
    pool.cache_full_blocks(request, blocks, 0, 2, BS)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    hit = pool.get_cached_block(request.block_hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])
    assert (hit.ref_cnt, free_ids(pool)) == (1, [3, 2])
    assert hit.block_hash == request.block_hashes[0]  # a hit keeps its hash


def test_cache_full_blocks_covers_only_the_newly_full_range() -> None:
    pool = BlockPool(8, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    sql = LoraAdapter(name="sql", int_id=5, path="/adapters/sql")
    request = Request("r", range(10), BlockHasher(BS), lora=sql, cache_salt="tenant-a")
    digests = request.block_hashes
    pool.cache_full_blocks(request, blocks, 0, 1, BS)
    pool.cache_full_blocks(request, blocks, 1, 1, BS)  # nothing newly full: no event
    request.append_output_token_ids([10, 11])
    pool.cache_full_blocks(request, blocks, 1, 3, BS)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=[wire_hash(digests[0])],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=BS,
            lora_id=5,
            medium="GPU",
            lora_name="sql",
            extra_keys=[("sql", "tenant-a")],
            group_idx=0,
        ),
        BlockStored(
            block_hashes=[wire_hash(digests[1]), wire_hash(digests[2])],
            parent_block_hash=wire_hash(digests[0]),
            token_ids=list(range(4, 12)),
            block_size=BS,
            lora_id=5,
            medium="GPU",
            lora_name="sql",
            extra_keys=[("sql",), ("sql",)],
            group_idx=0,
        ),
    ]
    assert [b.block_hash for b in blocks] == digests
    with pytest.raises(ValueError, match="has 3 block hashes, cannot cache 4 full blocks"):
        pool.cache_full_blocks(request, [*blocks, *pool.get_new_blocks(1)], 3, 4, BS)


def test_evict_blocks_removes_cached_blocks_wherever_they_are() -> None:
    pool = BlockPool(5, enable_kv_cache_events=True, medium="CPU")
    blocks = pool.get_new_blocks(3)
    request = Request("r", range(8), BlockHasher(BS))
    pool.cache_full_blocks(request, blocks, 0, 2, BS)
    pool.free_blocks([blocks[1]])
    pool.take_events()
    pool.evict_blocks([2, 1, 3, 4])  # 2: free and cached; 1: in use; 3, 4: not cached
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[wire_hash(request.block_hashes[i])], medium="CPU", group_idx=0)
        for i in (1, 0)
    ]
    assert (blocks[0].block_hash, blocks[0].ref_cnt) == (None, 1)
    assert free_ids(pool) == [4, 2]
    assert len(pool.cached_block_hash_to_block) == 0


def test_reset_prefix_cache_only_when_every_block_is_free() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    request = Request("r", range(8), BlockHasher(BS))
    pool.cache_full_blocks(request, blocks, 0, 2, BS)
    pool.take_events()
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert free_ids(pool) == [3, 2, 1]
    assert block_ids(pool.get_new_blocks(3)) == [3, 2, 1]
    assert pool.take_events() == []  # no BlockRemoved after a reset


def test_events_off_records_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(Request("r", range(8), BlockHasher(BS)), blocks, 0, 2, BS)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == []


def test_pool_needs_the_null_block() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0)
