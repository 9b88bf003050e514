"""kvroute router: the global prefix index, cache-aware routing and the HTTP front.

The names below are the package's public API for embedding a router, building an index or
scoring requests from Python; the folders hold the rest (``router.front``, ``router.index``,
``router.ingest``, ``router.routing``, ...). Names load on first use, so ``import router``
stays cheap: the command line imports only what its subcommand needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from router.errors import OrphanParentError, PrefixIndexError, RouterError

if TYPE_CHECKING:
    from router.front.config import RouterConfig
    from router.front.service import RouterService
    from router.index.base import IndexStats, PrefixIndex, PrefixMatch
    from router.index.group_commit import GroupCommitIndex
    from router.index.memory import MemoryPrefixIndex
    from router.index.redis_index import RedisPrefixIndex
    from router.ingest.bridged_index import BridgedIndex
    from router.offline.explain import explain_request
    from router.routing.cost import CostWeights
    from router.routing.policies import (
        Candidate,
        Decision,
        PolicyConfig,
        RouteRequest,
        RoutingPolicy,
        make_policy,
    )
    from router.sim.engine import SimConfig, simulate
    from router.store.layout import KeyLayout
    from router.workers.registry import WorkerRecord, WorkerRegistry

__all__ = [
    "BridgedIndex",
    "Candidate",
    "CostWeights",
    "Decision",
    "GroupCommitIndex",
    "IndexStats",
    "KeyLayout",
    "MemoryPrefixIndex",
    "OrphanParentError",
    "PolicyConfig",
    "PrefixIndex",
    "PrefixIndexError",
    "PrefixMatch",
    "RedisPrefixIndex",
    "RouteRequest",
    "RouterConfig",
    "RouterError",
    "RouterService",
    "RoutingPolicy",
    "SimConfig",
    "WorkerRecord",
    "WorkerRegistry",
    "explain_request",
    "make_policy",
    "simulate",
]

_HOMES: Final[dict[str, str]] = {
    "BridgedIndex": "router.ingest.bridged_index",
    "Candidate": "router.routing.policies",
    "CostWeights": "router.routing.cost",
    "Decision": "router.routing.policies",
    "GroupCommitIndex": "router.index.group_commit",
    "IndexStats": "router.index.base",
    "KeyLayout": "router.store.layout",
    "MemoryPrefixIndex": "router.index.memory",
    "PolicyConfig": "router.routing.policies",
    "PrefixIndex": "router.index.base",
    "PrefixMatch": "router.index.base",
    "RedisPrefixIndex": "router.index.redis_index",
    "RouteRequest": "router.routing.policies",
    "RouterConfig": "router.front.config",
    "RouterService": "router.front.service",
    "RoutingPolicy": "router.routing.policies",
    "SimConfig": "router.sim.engine",
    "WorkerRecord": "router.workers.registry",
    "WorkerRegistry": "router.workers.registry",
    "explain_request": "router.offline.explain",
    "make_policy": "router.routing.policies",
    "simulate": "router.sim.engine",
}
"""Where each lazily loaded public name is defined."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
