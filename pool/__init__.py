"""kvroute pool: vLLM V1 BlockPool and KVCacheManager, paged KV cache and the worker."""

from pool.errors import PoolError

__all__ = ["PoolError"]
