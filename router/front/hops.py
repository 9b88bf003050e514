"""The router hop header: refuses a request that has already passed through this router.

A worker URL that points at a router (this one, or another that points back) would
otherwise forward one request in a loop until every hop's timeouts or connections run
out. Each replica appends its replica id to ``X-Kvroute-Hops`` on every request it
proxies, and refuses (508 Loop Detected, never forwarded) a request whose header already
names it, or that has passed through :data:`MAX_HOPS` routers. Chained routers with
distinct ids (a router in front of another) stay allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["HOPS_HEADER", "MAX_HOPS", "hop_refusal", "next_hops"]

HOPS_HEADER: Final = "X-Kvroute-Hops"
MAX_HOPS: Final = 8
"""Most routers a request may pass through (a chain longer than this is a loop)."""


def _hops(headers: Mapping[str, str]) -> list[str]:
    raw = headers.get(HOPS_HEADER, "")
    return [hop.strip() for hop in raw.split(",") if hop.strip()]


def hop_refusal(headers: Mapping[str, str], replica_id: str) -> str | None:
    """Why a request with these headers must not be forwarded by ``replica_id``, or None."""
    hops = _hops(headers)
    if replica_id in hops:
        return (
            f"routing loop: this request already passed through router {replica_id!r} "
            f"(hops: {', '.join(hops)}); a registered worker URL points at a router"
        )
    if len(hops) >= MAX_HOPS:
        return f"routing loop: this request passed through {len(hops)} routers ({', '.join(hops)})"
    return None


def next_hops(headers: Mapping[str, str], replica_id: str) -> str:
    """The hop header value to send on: the request's hops, then ``replica_id``."""
    return ",".join([*_hops(headers), replica_id])
