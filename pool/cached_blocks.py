"""The prefix cache map: block hash digest → the physical block(s) caching it.

Usually one hash is cached in one block, stored as the block itself. The same hash can be
cached in several physical blocks (two requests computed the same block, e.g. a prompt that
is an exact multiple of the block size recomputes its last block); then the value becomes a
``{block_id: block}`` dict. Keeping the single case unwrapped saves a dict per cached block,
and the batch methods save a call per block on the pool's hot paths (cache, evict);
``benchmarks/bench_pool.py`` measures them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pool.block import KVCacheBlock

__all__ = ["BlockHashToBlockMap"]


class BlockHashToBlockMap:
    """Maps each cached block hash to the block, or blocks, that hold it.

    Blocks are filed under their own ``block_hash``: the pool sets it before
    :meth:`insert_blocks` and resets it after :meth:`remove_blocks`.

    NOTE: every block reachable from the map has ``block_hash`` equal to its key, and a
    block is reachable under at most one key.
    """

    __slots__ = ("_cache", "_num_blocks")

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._num_blocks = 0

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """Any block caching ``key`` (the first one cached among copies), or ``None``."""
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        assert isinstance(entry, dict)
        return next(iter(entry.values()))

    def insert_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """File each block under its own ``block_hash``, which must be set.

        Raises:
            ValueError: A block has no hash.
        """
        cache = self._cache
        num_blocks = 0
        for block in blocks:
            key = block.block_hash
            if key is None:
                raise ValueError(f"block {block.block_id} has no hash to be cached under")
            entry = cache.get(key)
            if entry is None:
                cache[key] = block
            elif type(entry) is KVCacheBlock:
                cache[key] = {entry.block_id: entry, block.block_id: block}
            else:
                assert isinstance(entry, dict)
                entry[block.block_id] = block
            num_blocks += 1
        self._num_blocks += num_blocks

    def remove_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unfile each block from under its own ``block_hash`` (which it keeps).

        Raises:
            KeyError: A block is not filed under its ``block_hash``; blocks before it were
                removed.
        """
        cache = self._cache
        num_blocks = 0
        try:
            for block in blocks:
                key = block.block_hash
                entry = None if key is None else cache.get(key)
                if key is None or entry is None:
                    raise KeyError(f"block {block.block_id} is not cached")
                if entry is block:
                    del cache[key]
                elif type(entry) is dict and entry.get(block.block_id) is block:
                    del entry[block.block_id]
                    if len(entry) == 1:
                        cache[key] = next(iter(entry.values()))
                else:
                    raise KeyError(f"block {block.block_id} is not cached under its hash")
                num_blocks += 1
        finally:
            self._num_blocks -= num_blocks

    def items(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """``(hash, block)`` for every cached physical block, copies included."""
        for key, entry in self._cache.items():
            if type(entry) is KVCacheBlock:
                yield key, entry
            else:
                assert isinstance(entry, dict)
                for block in entry.values():
                    yield key, block

    @property
    def num_blocks(self) -> int:
        """Number of cached physical blocks (a hash cached twice counts twice)."""
        return self._num_blocks

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        """Number of distinct cached hashes."""
        return len(self._cache)
