"""PagedKVCache: layout, slot addressing, isolation between blocks, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pool.worker.paged_cache import PagedCacheConfig, PagedCacheError, PagedKVCache


def _cache(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(
        PagedCacheConfig(
            num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_dim=3
        )
    )


def test_layout_and_size() -> None:
    cache = _cache()
    assert tuple(cache.kv.shape) == (2, 2, 8, 4, 2, 3)
    assert cache.nbytes == 2 * 2 * 8 * 4 * 2 * 3 * 4
    assert cache.config.bytes_per_block == 2 * 2 * 4 * 2 * 3 * 4
    assert cache.device == torch.device("cpu")


def test_slot_mapping_follows_the_block_table() -> None:
    cache = _cache()
    slots = cache.slot_mapping([5, 2, 7], 2, 10)
    assert slots.tolist() == [22, 23, 8, 9, 10, 11, 28, 29]
    assert cache.slot_mapping([5], 0, 0).tolist() == []


def test_write_lands_in_the_addressed_block_and_nowhere_else() -> None:
    cache = _cache()
    key = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    slots = cache.slot_mapping([6, 1], 0, 6)
    cache.write(1, slots, key, -key)
    assert torch.equal(cache.kv[1, 0, 6], key[:4])
    assert torch.equal(cache.kv[1, 0, 1, :2], key[4:])
    assert torch.equal(cache.kv[1, 1, 6], -key[:4])
    assert int(torch.count_nonzero(cache.kv[0])) == 0
    assert int(torch.count_nonzero(cache.kv[1, :, [0, 2, 3, 4, 5, 7]])) == 0
    read_k, read_v = cache.read(1, slots)
    assert torch.equal(read_k, key)
    assert torch.equal(read_v, -key)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    table=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_write_then_read_round_trips_any_span(table: list[int], data: st.DataObject) -> None:
    cache = _cache()
    end = data.draw(st.integers(1, len(table) * 4))
    start = data.draw(st.integers(0, end - 1))
    key = torch.randn(end - start, 2, 3)
    value = torch.randn(end - start, 2, 3)
    cache.write(0, cache.slot_mapping(table, start, end), key, value)
    read_k, read_v = cache.read(0, cache.slot_mapping(table, start, end))
    assert torch.equal(read_k, key)
    assert torch.equal(read_v, value)


def test_addressing_errors_say_what_was_wrong() -> None:
    cache = _cache()
    with pytest.raises(PagedCacheError, match=r"positions \[0, 9\) do not fit a table of 2"):
        cache.slot_mapping([0, 1], 0, 9)
    with pytest.raises(PagedCacheError, match=r"block ids must be in \[0, 8\), got \[0, 8\]"):
        cache.slot_mapping([0, 8], 0, 5)
    with pytest.raises(PagedCacheError, match="num_blocks must be positive, got 0"):
        PagedCacheConfig(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=2)
