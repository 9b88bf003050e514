"""The trace simulator: real policies, index and pools, simulated time (``kvroute sim``)."""

from router.sim.engine import RequestOutcome, SimConfig, WorkerCache, WorkerCacheFactory, simulate
from router.sim.report import PolicyResult, format_table, summarize
from router.sim.trace import IdealHits, SimError, SimRequest, ideal_hits, load_trace, to_requests

__all__ = [
    "IdealHits",
    "PolicyResult",
    "RequestOutcome",
    "SimConfig",
    "SimError",
    "SimRequest",
    "WorkerCache",
    "WorkerCacheFactory",
    "format_table",
    "ideal_hits",
    "load_trace",
    "simulate",
    "summarize",
    "to_requests",
]
