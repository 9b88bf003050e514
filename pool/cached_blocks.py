"""The prefix cache map: block hash digest → the physical block(s) caching it.

Usually one hash is cached in one block, stored as the block itself. The same hash can be
cached in several physical blocks (two requests computed the same block, e.g. a prompt that
is an exact multiple of the block size recomputes its last block); then the value becomes a
``{block_id: block}`` dict. Keeping the single case unwrapped saves a dict per cached
block on the hot paths (``insert`` on cache, ``pop`` on eviction, ``get_one_block`` on a
hit); ``benchmarks/bench_pool.py`` measures them.
"""

from __future__ import annotations

from collections.abc import Iterator

from pool.block import KVCacheBlock

__all__ = ["BlockHashToBlockMap"]


class BlockHashToBlockMap:
    """Maps each cached block hash to the block, or blocks, that hold it.

    NOTE: every block reachable from the map has ``block_hash`` equal to its key, and a
    block is reachable under at most one key.
    """

    __slots__ = ("_cache", "_num_blocks")

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._num_blocks = 0

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """Any block caching ``key`` (the first one cached among duplicates), or ``None``."""
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        assert isinstance(entry, dict)
        return next(iter(entry.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        """Record that ``block`` caches ``key``."""
        cache = self._cache
        entry = cache.get(key)
        if entry is None:
            cache[key] = block
        elif type(entry) is KVCacheBlock:
            cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            assert isinstance(entry, dict)
            entry[block.block_id] = block
        self._num_blocks += 1

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Forget that block ``block_id`` caches ``key``.

        Returns:
            The block, or ``None`` when that block does not cache ``key`` (nothing changes).
        """
        cache = self._cache
        entry = cache.get(key)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del cache[key]
            self._num_blocks -= 1
            return entry
        assert isinstance(entry, dict)
        block = entry.pop(block_id, None)
        if block is None:
            return None
        if len(entry) == 1:
            cache[key] = next(iter(entry.values()))
        self._num_blocks -= 1
        return block

    def blocks(self) -> Iterator[KVCacheBlock]:
        """Every cached physical block, duplicates included (for tests and snapshots)."""
        for entry in self._cache.values():
            if type(entry) is KVCacheBlock:
                yield entry
            else:
                assert isinstance(entry, dict)
                yield from entry.values()

    @property
    def num_blocks(self) -> int:
        """Number of cached physical blocks (a hash cached twice counts twice)."""
        return self._num_blocks

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        """Number of distinct cached hashes."""
        return len(self._cache)
