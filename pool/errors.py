"""Error hierarchy of the ``pool`` package."""

from __future__ import annotations

__all__ = ["InvalidRequestError", "NoFreeBlocksError", "PoolError"]


class PoolError(Exception):
    """Base of every error raised by the ``pool`` package."""


class NoFreeBlocksError(PoolError, ValueError):
    """The pool has fewer free blocks than were asked for (vLLM raises ``ValueError``)."""


class InvalidRequestError(PoolError, ValueError):
    """A request can never be served (empty, out of vocabulary, larger than the cache...)."""
