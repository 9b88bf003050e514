"""The global prefix index: the ``PrefixIndex`` seam and its implementations."""

from router.index.base import IndexStats, PrefixIndex, PrefixMatch, WorkerId
from router.index.memory import MemoryPrefixIndex

__all__ = ["IndexStats", "MemoryPrefixIndex", "PrefixIndex", "PrefixMatch", "WorkerId"]
