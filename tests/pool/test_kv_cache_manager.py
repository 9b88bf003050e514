"""KVCacheManager: longest hit, allocate/free, duplicates and the exact event sequence."""

from __future__ import annotations

import msgspec
import pytest

from events.extra_keys import LoraAdapter
from events.hashing import hash_blocks_sha256_cbor, wire_hash
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from pool.block import KVCacheBlock
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager, PrefixCacheStats
from pool.request import Request

BS = 4
SQL = LoraAdapter(name="sql", int_id=3, path="/adapters/sql")


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def make_manager(num_blocks: int, **kwargs: bool) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, **kwargs))


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def admit(manager: KVCacheManager, request: Request) -> list[KVCacheBlock] | None:
    """The scheduler's admission of a new request: look up hits, allocate, prefill."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def stored(
    digests: list[bytes], start: int, stop: int, tokens: list[int], parent: bytes | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=[wire_hash(d) for d in digests[start:stop]],
        parent_block_hash=None if parent is None else wire_hash(parent),
        token_ids=tokens[start * BS : stop * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * (stop - start),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(digest: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=[wire_hash(digest)], medium="GPU", group_idx=0)


def test_exact_event_sequence_with_a_hash_cached_in_two_blocks() -> None:
    manager = make_manager(6, enable_kv_cache_events=True)  # capacity 5
    prompt = list(range(1, 9))  # exactly two blocks
    digests = hash_blocks_sha256_cbor(prompt, BS)
    a = manager.make_request("a", prompt)
    assert ids(admit(manager, a) or []) == [1, 2]

    # Same prompt: block 0 hits, block 1 is recomputed (the last token is never a hit),
    # so the hash of block 1 is now cached in two physical blocks.
    b = manager.make_request("b", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([1], 4)
    assert ids(manager.allocate_slots(b, 4, 4, hits) or []) == [3]
    assert manager.get_block_ids("b") == [1, 3]
    cache = manager.block_pool.cached_block_hash_to_block
    assert (len(cache), cache.num_blocks) == (2, 3)
    assert manager.take_events() == [
        stored(digests, 0, 2, prompt),
        stored(digests, 1, 2, prompt, parent=digests[0]),
    ]

    manager.free(a)
    manager.free(b)
    assert free_ids(manager) == [4, 5, 2, 3, 1]

    # Four new blocks: the two uncached ones, then both copies of block 1's hash.
    other = list(range(100, 116))
    c = manager.make_request("c", other)
    assert ids(admit(manager, c) or []) == [4, 5, 2, 3]
    assert manager.take_events() == [
        removed(digests[1]),
        removed(digests[1]),
        stored(hash_blocks_sha256_cbor(other, BS), 0, 4, other),
    ]
    assert manager.block_pool.get_cached_block(digests[0]) is manager.block_pool.blocks[1]

    d = manager.make_request("d", list(range(200, 206)))
    assert admit(manager, d) is None  # needs 2 blocks, 1 is free
    assert manager.get_block_ids("d") == []
    assert manager.reset_prefix_cache() is False
    manager.free(c)
    assert manager.reset_prefix_cache() is True
    assert manager.take_events() == [AllBlocksCleared()]

    # The events travel in vLLM's wire shape unchanged.
    batch = KVEventBatch(ts=1.5, events=[stored(digests, 0, 2, prompt), removed(digests[1])])
    assert decode_batch(encode_batch(batch)) == batch


def test_longest_hit_stops_at_the_first_miss_and_spares_the_last_token() -> None:
    manager = make_manager(16)
    first = manager.make_request("a", range(12))
    admit(manager, first)
    manager.free(first)
    same = manager.make_request("b", range(12))
    assert manager.get_computed_blocks(same)[1] == 8
    longer = manager.make_request("c", range(13))
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert (ids(hits), num_hit_tokens) == ([1, 2, 3], 12)
    forked = manager.make_request("d", [*range(4), 99, *range(5, 13)])
    assert manager.get_computed_blocks(forked)[1] == 4
    assert manager.prefix_cache_stats == PrefixCacheStats(requests=4, queries=50, hits=24)
    assert manager.prefix_cache_stats.hit_rate == 24 / 50


def test_lora_and_salt_separate_caches() -> None:
    manager = make_manager(16)
    admit(manager, manager.make_request("a", range(9), lora=SQL))
    assert manager.get_computed_blocks(manager.make_request("b", range(9)))[1] == 0
    salted = manager.make_request("c", range(9), lora=SQL, cache_salt="t")
    assert manager.get_computed_blocks(salted)[1] == 0
    assert manager.get_computed_blocks(manager.make_request("d", range(9), lora=SQL))[1] == 8
    moved = LoraAdapter(name="sql", int_id=3, path="/elsewhere/sql")
    assert manager.get_computed_blocks(manager.make_request("e", range(9), lora=moved))[1] == 0


def test_allocate_counts_free_cached_hits_against_capacity() -> None:
    manager = make_manager(5)  # capacity 4
    a = manager.make_request("a", range(12))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [4, 3, 2, 1]
    # 3 hits that sit in the free queue and 2 new blocks: 3 + 2 > 4 free blocks.
    b = manager.make_request("b", range(17))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([1, 2, 3], 12)
    assert manager.allocate_slots(b, 5, num_hit_tokens, hits) is None
    assert free_ids(manager) == [4, 3, 2, 1]
    assert [block.ref_cnt for block in hits] == [0, 0, 0]
    # 2 free hits and 1 new block fit.
    c = manager.make_request("c", range(10))
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert ids(manager.allocate_slots(c, 2, num_hit_tokens, hits) or []) == [4]
    assert manager.get_block_ids("c") == [1, 2, 4]
    assert free_ids(manager) == [3]
    assert manager.usage == 0.75


def test_decode_caches_each_block_as_it_fills_and_frees_in_reverse() -> None:
    manager = make_manager(8, enable_kv_cache_events=True)
    request = manager.make_request("r", range(6))
    assert ids(admit(manager, request) or []) == [1, 2]
    tokens = list(range(6))
    digests = hash_blocks_sha256_cbor(list(range(8)), BS)
    assert manager.take_events() == [stored(digests, 0, 1, tokens)]
    for token in (6, 7, 8):
        request.append_output_token_ids(token)
        tokens.append(token)
        new_blocks = manager.allocate_slots(request, 1)
        assert new_blocks is not None
        request.num_computed_tokens += 1
        assert ids(new_blocks) == ([3] if token == 8 else [])
    assert manager.take_events() == [stored(digests, 1, 2, tokens, parent=digests[0])]
    assert manager.get_block_ids("r") == [1, 2, 3]
    manager.free(request)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 2, 1]
    manager.free(request)  # freeing twice is harmless
    assert manager.get_block_ids("r") == []


def test_caching_off_never_hashes_hits_or_emits() -> None:
    manager = make_manager(8, enable_caching=False, enable_kv_cache_events=True)
    a = manager.make_request("a", range(8))
    assert a.block_hashes == []
    admit(manager, a)
    b = manager.make_request("b", range(8))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert ids(admit(manager, b) or []) == [3, 4]
    assert manager.take_events() == []
    assert manager.prefix_cache_stats == PrefixCacheStats()


def test_allocate_slots_rejects_bad_arguments() -> None:
    manager = make_manager(8)
    a = manager.make_request("a", range(8))
    admit(manager, a)
    manager.free(a)
    b = manager.make_request("b", range(8))
    with pytest.raises(ValueError, match="num_new_tokens must be at least 1, got 0"):
        manager.allocate_slots(b, 0)
    admit(manager, b)
    hits, _ = manager.get_computed_blocks(manager.make_request("c", range(8)))
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(b, 1, 4, hits)


def test_block_stored_has_vllm_033_shape_and_the_test_vector_hashes() -> None:
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=4, block_size=16, enable_kv_cache_events=True)
    )
    admit(manager, manager.make_request("r", range(1, 33)))
    (event,) = manager.take_events()
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.5, events=[event])))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [8866452693264111234, 807986237951177663],
                "parent_block_hash": None,
                "token_ids": list(range(1, 33)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ],
        None,
    ]
    # Key order: docs/vllm-compat.md's map-encoded example, then the spec kind that vLLM 0.33's
    # KV cache manager adds (its sliding window, None, is omitted).
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
        "full_attention",
        None,
    )


def test_block_stored_of_a_lora_request_with_a_cache_salt() -> None:
    """vLLM 0.33's fields: lora_id is the adapter's int id, extra_keys untagged (LoRA name
    on every block, the salt after it on block 0), hashes of the tagged keys."""
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=8, block_size=16, enable_kv_cache_events=True)
    )
    lora = LoraAdapter(name="sql-adapter", int_id=7, path="/adapters/sql")
    admit(manager, manager.make_request("r", range(1, 33), lora=lora, cache_salt="tenant-a"))
    assert manager.take_events() == [
        BlockStored(
            block_hashes=[14092093597078032933, 6008205350856969516],
            parent_block_hash=None,
            token_ids=list(range(1, 33)),
            block_size=16,
            lora_id=7,
            medium="GPU",
            lora_name="sql-adapter",
            extra_keys=[("sql-adapter", "tenant-a"), ("sql-adapter",)],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    salted = manager.make_request("s", range(101, 133), cache_salt="tenant-a")
    admit(manager, salted)
    (event,) = manager.take_events()
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name, event.extra_keys) == (None, None, [("tenant-a",), None])


def test_chunked_prefill_caches_each_chunk_s_full_blocks() -> None:
    manager = make_manager(8, enable_kv_cache_events=True)
    prompt = list(range(10))
    digests = hash_blocks_sha256_cbor(prompt, BS)
    request = manager.make_request("r", prompt)
    assert manager.get_computed_blocks(request) == ([], 0)
    assert ids(manager.allocate_slots(request, 5) or []) == [1, 2]
    request.num_computed_tokens = 5
    assert ids(manager.allocate_slots(request, 5) or []) == [3]
    request.num_computed_tokens = 10
    assert manager.take_events() == [
        stored(digests, 0, 1, prompt),
        stored(digests, 1, 2, prompt, parent=digests[0]),
    ]
