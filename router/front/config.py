"""Configuration of one router replica: what ``kvroute router`` flags and config files set.

:class:`RouterConfig` is the one frozen dataclass of the router service
(:mod:`router.front.service`); :class:`RequestLimits` bounds what clients may send.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from events.auth import BearerKey, SentKey
from events.curve import CurveKeyPair
from events.liveness import SocketLiveness
from events.subscriber import SubscriberConfig
from router.front.accuracy import AccuracyConfig
from router.front.breaker import BreakerConfig
from router.front.proxy_contracts import ProxyConfig
from router.front.tokenization import TokenizerSources
from router.ingest.watchdog import DEFAULT_IDLE_CHECK_S
from router.routing.policies import DEFAULT_POLICY, PolicyConfig
from router.routing.sessions import SessionConfig
from router.workers.registry import WorkerRecord

__all__ = ["RequestLimits", "RouterConfig"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what clients may send (a violation is a 4xx, never a crash).

    Attributes:
        max_body_bytes: Largest request body (413 above it).
        max_prompt_tokens: Longest prompt in tokens.
        max_output_tokens: Largest ``max_tokens``.
        max_messages: Most messages in a chat request.
        body_read_timeout_s: Longest time a client may take to send its body (408 after
            it: a slow or stalled client must not hold a connection and a handler).
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 131_072
    max_output_tokens: int = 65_536
    max_messages: int = 1_024
    body_read_timeout_s: float = 30.0


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router replica needs; flags of ``kvroute router`` map onto it.

    Attributes:
        redis_url: The Redis holding index, registry and shared load.
        namespace: Key namespace shared by the replicas of one cluster.
        host: Address the HTTP API binds (loopback by default).
        port: Its port (0: any free one).
        workers: Workers registered at start (more via ``POST /v1/workers``).
        policy: Routing policy name (see :data:`router.routing.policies.POLICY_NAMES`).
        policy_config: Cost weights and policy settings.
        key_seed: Router key seed (must match across replicas).
        tokenizers: Where each model's token ids come from (local tokenizers, the
            engines' ``POST /tokenize``); they must be the workers' own.
        decision_log: File that gets one JSON line per routing decision.
        limits: Request size limits.
        proxy: Forwarding timeouts and attempts.
        breaker: When a failing worker's circuit opens and for how long (see
            :mod:`router.front.breaker`).
        lease_ttl_s: Lease of a worker's index entries (a dead router's workers are
            reaped after it).
        lookup_timeout_s: Longest index lookup before routing without it.
        probe_interval_s: While degraded, how often a lookup tries Redis again.
        route_hold_s: How long a ``/v1/route`` decision counts as load on its worker
            (the gateway, not the router, sends the request).
        dead_after_s: A worker unreachable for this long loses its index entries and
            registration until it answers again (``None``: the lease TTL).
        predicted_max_entries: Bound on the predicted entries' (key, worker) credits
            (up to ~350 bytes each, 35 MB at the default); past it the oldest are
            forgotten early, which only costs possible cache misses.
        load_refresh_s: How often other replicas' load is re-read.
        health_poll_s: How often workers' own load reports are polled while they change
            (a worker whose report stays the same is polled less and less often:
            :class:`router.load.reports.WorkerReportPoller`).
        replica_id: This replica's id (random by default); it names the replica's leases,
            its ingest heartbeat and its shared-load hash.
        client_keys: The router's CURVE key pair for workers registered with a
            ``server_key`` (a fresh one by default).
        admin_key: Bearer key of the worker-registry endpoints (``None``: open); see
            :mod:`router.front.access`.
        api_key: Bearer key of the inference endpoints (``None``: open); the admin key
            is accepted there too.
        worker_admin_key: Sent to kvroute workers to read their ``GET /v1/snapshot``
            (their ``--admin-key``); None: sent nothing. The workers' API key, for
            forwarded requests, is ``proxy.worker_key``.
        allow_worker_nets: Networks (CIDR) and host names workers may be at; empty: any.
        require_curve: Admit only workers registered with a CURVE ``server_key``.
        replay_timeout_s: Longest silence accepted from a worker's replay endpoint.
        replay_deadline_s: Longest a whole replay may take, however steadily its replies
            come; past either, the replay is abandoned and the worker resynced.
        event_liveness: Heartbeats and TCP keepalive of the event and replay connections.
        event_idle_check_s: Quiet time after which a worker's stream has its position
            checked (0: never; see :mod:`router.ingest.watchdog`).
        accuracy: When routing accuracy (expected against reported hits) is warned about
            (see :mod:`router.front.accuracy`).
        sessions: Session affinity (see :mod:`router.routing.sessions`).
        otel: Make OpenTelemetry spans (see :mod:`router.front.tracing`).
        otel_required: ``otel`` was asked for explicitly: missing packages are an error.
    """

    redis_url: str
    namespace: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[WorkerRecord, ...] = ()
    policy: str = DEFAULT_POLICY
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    key_seed: int = 0
    tokenizers: TokenizerSources = field(default_factory=TokenizerSources)
    decision_log: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    lease_ttl_s: float = 10.0
    lookup_timeout_s: float = 0.5
    probe_interval_s: float = 1.0
    route_hold_s: float = 2.0
    dead_after_s: float | None = None
    predicted_max_entries: int = 100_000
    load_refresh_s: float = 0.05
    health_poll_s: float = 1.0
    replica_id: str | None = None
    client_keys: CurveKeyPair = field(default_factory=CurveKeyPair.generate)
    admin_key: BearerKey | None = None
    api_key: BearerKey | None = None
    worker_admin_key: SentKey | None = None
    allow_worker_nets: tuple[str, ...] = ()
    require_curve: bool = False
    replay_timeout_s: float = SubscriberConfig().replay_timeout_s
    replay_deadline_s: float = SubscriberConfig().replay_deadline_s
    event_liveness: SocketLiveness = field(default_factory=SocketLiveness)
    event_idle_check_s: float = DEFAULT_IDLE_CHECK_S
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    otel: bool = False
    otel_required: bool = False
