"""The trace simulator: real policies, index and pools, simulated time (``kvroute sim``),
and the bounds and synthetic traces it is measured with."""

from router.sim.bounds import pooled_lru_hits
from router.sim.engine import (
    DecisionHook,
    RequestOutcome,
    SimConfig,
    WorkerCache,
    WorkerCacheFactory,
    simulate,
)
from router.sim.report import PolicyResult, format_table, summarize
from router.sim.synthetic import chat_sessions, shifted_copies, write_trace
from router.sim.trace import IdealHits, SimError, SimRequest, ideal_hits, load_trace, to_requests

__all__ = [
    "DecisionHook",
    "IdealHits",
    "PolicyResult",
    "RequestOutcome",
    "SimConfig",
    "SimError",
    "SimRequest",
    "WorkerCache",
    "WorkerCacheFactory",
    "chat_sessions",
    "format_table",
    "ideal_hits",
    "load_trace",
    "pooled_lru_hits",
    "shifted_copies",
    "simulate",
    "summarize",
    "to_requests",
    "write_trace",
]
