"""kvroute pool: vLLM V1 BlockPool and KVCacheManager, paged KV cache and the worker."""

from pool.block import KVCacheBlock
from pool.block_pool import MEDIUM_GPU, BlockPool
from pool.cached_blocks import BlockHashToBlockMap
from pool.errors import NoFreeBlocksError, PoolError
from pool.free_queue import FreeKVCacheBlockQueue
from pool.kv_cache_manager import KVCacheConfig, KVCacheManager, PrefixCacheStats
from pool.request import BlockHasher, BlockHashFn, Request

__all__ = [
    "MEDIUM_GPU",
    "BlockHashFn",
    "BlockHashToBlockMap",
    "BlockHasher",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PoolError",
    "PrefixCacheStats",
    "Request",
]
