"""The global prefix index: the ``PrefixIndex`` seam and its implementations."""

from router.index.base import IndexStats, PrefixIndex, PrefixMatch, WorkerId
from router.index.bridge import WorkerBridge
from router.index.layout import KeyLayout
from router.index.memory import MemoryPrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.index.registry import Lease, WorkerRecord, WorkerRegistry
from router.index.scripts import StaleLeaseError

__all__ = [
    "IndexStats",
    "KeyLayout",
    "Lease",
    "MemoryPrefixIndex",
    "PrefixIndex",
    "PrefixMatch",
    "RedisPrefixIndex",
    "StaleLeaseError",
    "WorkerBridge",
    "WorkerId",
    "WorkerRecord",
    "WorkerRegistry",
]
