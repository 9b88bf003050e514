"""Identity types shared by every package: who a worker is, named once for all of them."""

from __future__ import annotations

from typing import NewType

__all__ = ["WorkerId"]

WorkerId = NewType("WorkerId", str)
"""A worker's identity, unique within a namespace (``--id`` of ``kvroute worker``)."""
