"""The global prefix index: the ``PrefixIndex`` seam and its implementations."""

from router.index.base import IndexStats, PrefixIndex, PrefixMatch, WorkerId

__all__ = ["IndexStats", "PrefixIndex", "PrefixMatch", "WorkerId"]
