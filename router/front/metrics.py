"""Prometheus metrics of the router service (routing, proxying, index health, shared load).

They live in the same caller-owned ``CollectorRegistry`` as the ingest's
:class:`router.ingest.metrics.IngestMetrics` (events applied, skipped, replayed, resynced), so
one ``GET /metrics`` shows both. Labels are bounded: worker ids, policy names, fixed
outcome words, model names the router knows (:mod:`router.front.model_labels`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.front.accuracy import EXPECTED_CACHED_TOKENS, REPORTED_CACHED_TOKENS
from router.front.breaker import CircuitState

__all__ = ["CIRCUIT_STATE_VALUES", "RouterMetrics"]

CIRCUIT_STATE_VALUES = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}
"""``kvroute_router_worker_circuit_state`` per state."""


class _CircuitCollector(Collector):
    """Exports each registered worker's circuit state at scrape time (it changes with time)."""

    def __init__(self, read: Callable[[], Mapping[str, CircuitState]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvroute_router_worker_circuit_state",
            "Each worker's circuit: 0 closed (routed to), 1 half-open (one trial request "
            "let through), 2 open (skipped).",
            labels=["worker"],
        )
        for worker, state in self._read().items():
            family.add_metric([worker], CIRCUIT_STATE_VALUES[state])
        yield family


_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
# Whole requests: a cached short prompt answers in milliseconds, a long generation in minutes.
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0)  # fmt: skip


@dataclass
class RouterMetrics:
    """Metrics of routing decisions and proxying (``kvroute_router_*``).

    Args:
        registry: Where the metrics are registered (a fresh one by default).
    """

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds",
            "Time to decide a route (keys, index lookup, load, policy).",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_router_decisions",
            "Routing decisions, by chosen worker and policy (dry runs excluded).",
            ["worker", "policy"],
            registry=r,
        )
        self.matched_tokens = Counter(
            "kvroute_router_matched_tokens",
            "Prompt tokens the chosen worker's events confirmed cached at decision time.",
            ["worker"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            "kvroute_router_predicted_tokens",
            "Prompt tokens the router expected the chosen worker to hit (predicted "
            "entries included).",
            ["worker"],
            registry=r,
        )
        self.expected_cached_tokens = Counter(
            EXPECTED_CACHED_TOKENS,
            "Prompt tokens the router expected the serving worker to find cached (what its "
            "decision credited that worker with, in whole blocks, short of the last prompt "
            "token); counted for requests whose worker reported its hit.",
            ["worker"],
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            REPORTED_CACHED_TOKENS,
            "Prompt tokens the serving worker reported found in its prefix cache "
            "(usage.cached_tokens, or vLLM's usage.prompt_tokens_details.cached_tokens).",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_router_prompt_tokens",
            "Prompt tokens of the requests each worker served (as the worker counted them "
            "in usage.prompt_tokens; the router's own count when the answer had none).",
            ["worker"],
            registry=r,
        )
        self.unreported_hits = Counter(
            "kvroute_router_unreported_cached_tokens_requests",
            "Requests a worker served without reporting cached tokens (a vLLM engine "
            "without --enable-prompt-tokens-details): left out of the accuracy figures.",
            ["worker"],
            registry=r,
        )
        self.time_to_first_token_seconds = Histogram(
            "kvroute_router_time_to_first_token_seconds",
            "Streamed requests: from the router receiving the request to the first event "
            "of the worker's answer (queueing, decision, connection and prefill).",
            ["worker", "model"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency_seconds = Histogram(
            "kvroute_router_e2e_request_latency_seconds",
            "From the router receiving a request to the last byte of its answer going to "
            "the client (every attempt included), for requests a worker answered.",
            ["worker", "model"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "kvroute_router_queue_seconds",
            "From the router receiving a request to its dispatch to the first worker "
            "tried (body read, tokenization, decision, waiting for a connection).",
            ["model"],
            buckets=(*_LATENCY_BUCKETS, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.index_live = Gauge(
            "kvroute_router_index_live",
            "1 while the Redis prefix index answers, 0 while routing is degraded to load only.",
            registry=r,
        )
        self.index_errors = Counter(
            "kvroute_router_index_errors",
            "Index operations that failed on the routing path, by operation.",
            ["operation"],
            registry=r,
        )
        self.shared_load_live = Gauge(
            "kvroute_router_shared_load_live",
            "1 while load is shared with other replicas through Redis, 0 when local only.",
            registry=r,
        )
        self.proxy_attempts = Counter(
            "kvroute_router_proxy_attempts",
            "Attempts to forward a request to a worker, by outcome (ok: answered below "
            "500; failed: the worker's fault; aborted: the client left).",
            ["worker", "outcome"],
            registry=r,
        )
        self.circuit_opens = Counter(
            "kvroute_router_circuit_opens",
            "Times a worker's circuit opened (it failed repeatedly, or could not be reached).",
            ["worker"],
            registry=r,
        )
        self.client_aborts = Counter(
            "kvroute_router_client_aborts",
            "Requests whose client left before the answer was complete, by stage (body: "
            "while sending its body; answer: while waiting for or reading the answer).",
            ["stage"],
            registry=r,
        )
        self.index_writable = Gauge(
            "kvroute_router_index_writable",
            "1 while Redis takes the router's index writes, 0 after one failed (routing "
            "then degrades to load only until a write succeeds).",
            registry=r,
        )
        self.requests = Counter(
            "kvroute_router_http_requests",
            "HTTP requests answered by the router, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.invalid_registrations = Counter(
            "kvroute_router_invalid_registrations",
            "Worker registrations read from Redis and skipped (invalid, or refused by this "
            "router's policy); each saved value is counted once.",
            registry=r,
        )

    def watch_circuits(self, read: Callable[[], Mapping[str, CircuitState]]) -> None:
        """Export ``kvroute_router_worker_circuit_state`` from ``read`` (called per scrape)."""
        self.registry.register(_CircuitCollector(read))
