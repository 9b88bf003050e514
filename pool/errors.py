"""Error hierarchy of the ``pool`` package."""

from __future__ import annotations

__all__ = ["PoolError"]


class PoolError(Exception):
    """Base of every error raised by the ``pool`` package."""
