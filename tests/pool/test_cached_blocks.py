"""The hash → block map: single blocks, duplicates in several blocks, exact pops."""

from __future__ import annotations

from pool.block import KVCacheBlock
from pool.cached_blocks import BlockHashToBlockMap

H1 = b"\x01" * 32
H2 = b"\x02" * 32


def test_single_block_insert_get_pop() -> None:
    cache = BlockHashToBlockMap()
    block = KVCacheBlock(3)
    assert cache.get_one_block(H1) is None
    cache.insert(H1, block)
    assert cache.get_one_block(H1) is block
    assert H1 in cache and H2 not in cache
    assert (len(cache), cache.num_blocks) == (1, 1)
    assert cache.pop(H1, 4) is None  # another block id: nothing changes
    assert cache.get_one_block(H1) is block
    assert cache.pop(H2, 3) is None
    assert cache.pop(H1, 3) is block
    assert (len(cache), cache.num_blocks) == (0, 0)


def test_duplicates_are_kept_per_block_and_first_one_is_returned() -> None:
    cache = BlockHashToBlockMap()
    first, second, third = KVCacheBlock(5), KVCacheBlock(2), KVCacheBlock(9)
    cache.insert(H1, first)
    cache.insert(H1, second)
    cache.insert(H1, third)
    cache.insert(H2, KVCacheBlock(1))
    assert (len(cache), cache.num_blocks) == (2, 4)
    assert cache.get_one_block(H1) is first
    assert sorted(b.block_id for b in cache.blocks()) == [1, 2, 5, 9]
    assert cache.pop(H1, 5) is first
    assert cache.get_one_block(H1) is second
    assert cache.pop(H1, 7) is None
    assert cache.pop(H1, 9) is third
    assert cache.get_one_block(H1) is second
    assert cache.pop(H1, 2) is second
    assert H1 not in cache
    assert (len(cache), cache.num_blocks) == (1, 1)
