"""Error hierarchy of the ``router`` package."""

from __future__ import annotations

__all__ = ["RouterError"]


class RouterError(Exception):
    """Base of every error raised by the ``router`` package."""
