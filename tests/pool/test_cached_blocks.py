"""The hash → block map: single blocks, one hash in several blocks, exact removals."""

from __future__ import annotations

import pytest

from pool.block import KVCacheBlock
from pool.cached_blocks import BlockHashToBlockMap

H1 = b"\x01" * 32
H2 = b"\x02" * 32


def hashed(block_id: int, block_hash: bytes) -> KVCacheBlock:
    block = KVCacheBlock(block_id)
    block.block_hash = block_hash
    return block


def test_single_block_insert_get_remove() -> None:
    cache = BlockHashToBlockMap()
    block = hashed(3, H1)
    assert cache.get_one_block(H1) is None
    cache.insert_blocks([block])
    assert cache.get_one_block(H1) is block
    assert H1 in cache and H2 not in cache
    assert (len(cache), cache.num_blocks) == (1, 1)
    with pytest.raises(KeyError, match="block 4 is not cached under its hash"):
        cache.remove_blocks([hashed(4, H1)])  # another block with the same hash
    with pytest.raises(KeyError, match="block 5 is not cached"):
        cache.remove_blocks([hashed(5, H2)])
    assert cache.get_one_block(H1) is block
    cache.remove_blocks([block])
    assert block.block_hash == H1  # the caller resets it
    assert (len(cache), cache.num_blocks) == (0, 0)
    assert cache.get_one_block(H1) is None


def test_copies_are_kept_per_block_and_the_first_one_is_returned() -> None:
    cache = BlockHashToBlockMap()
    first, second, third, other = hashed(5, H1), hashed(2, H1), hashed(9, H1), hashed(1, H2)
    cache.insert_blocks([first, second, third, other])
    assert (len(cache), cache.num_blocks) == (2, 4)
    assert cache.get_one_block(H1) is first
    assert sorted((b.block_id, k) for k, b in cache.items()) == [(1, H2), (2, H1), (5, H1), (9, H1)]
    cache.remove_blocks([first])
    assert cache.get_one_block(H1) is second
    with pytest.raises(KeyError, match="block 7 is not cached under its hash"):
        cache.remove_blocks([hashed(7, H1)])
    cache.remove_blocks([third])
    assert cache.get_one_block(H1) is second
    assert (len(cache), cache.num_blocks) == (2, 2)
    cache.remove_blocks([second, other])
    assert (len(cache), cache.num_blocks) == (0, 0)


def test_a_block_without_hash_cannot_be_cached() -> None:
    cache = BlockHashToBlockMap()
    with pytest.raises(ValueError, match="block 1 has no hash to be cached under"):
        cache.insert_blocks([KVCacheBlock(1)])
    with pytest.raises(KeyError, match="block 1 is not cached"):
        cache.remove_blocks([KVCacheBlock(1)])
