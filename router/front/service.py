"""The router service: assembles index, ingest, policy, shared load, proxy and HTTP front.

:class:`RouterService` owns one router replica's life: it connects to Redis, ingests the
registered workers' event streams into the prefix index (:mod:`router.ingest.service`), shares
in-flight load with the other replicas (:mod:`router.load.shared`), keeps its worker set
(:mod:`router.front.membership`), decides routes among the workers a request may go to
(:mod:`router.front.candidates`, :mod:`router.front.decisions`) and forwards requests
(:mod:`router.front.proxy`) behind the HTTP API of :mod:`router.front.app`.

When the index lookup fails, or Redis refuses the ingest's writes (the index would go
stale), routing degrades to load alone (:mod:`router.front.lookup`): the index never
causes a 5xx. Each forwarded request's load is accounted by :mod:`router.front.load_accounting`;
each worker's failures by its circuit (:mod:`router.front.breaker`), which keeps a failing
worker out of routing decisions for a while.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Final

import aiohttp
from aiohttp import web

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.subscriber import SubscriberConfig
from router.errors import RouterError
from router.front.accuracy import AccuracyCollector, RoutingAccuracy
from router.front.breaker import CircuitBreakers
from router.front.candidates import Readiness, RoutableWorkers
from router.front.config import RouterConfig
from router.front.decision_log import DecisionLog
from router.front.decisions import Routed, RouteDecider
from router.front.engine_tokenizer import EngineTokenizer, TokenCache
from router.front.load_accounting import LoadAccounting, RouteHolds
from router.front.lookup import INDEX_ERRORS, IndexLookup
from router.front.membership import WorkerMembership
from router.front.metrics import RouterMetrics
from router.front.model_labels import ModelLabels
from router.front.proxy import WorkerProxy
from router.front.request_context import RequestContext
from router.front.served import ServedLedger
from router.front.tokenization import RequestTokenizer
from router.front.tracing import Tracing
from router.front.worker_view import WorkerView
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.capacity import raise_fd_limit
from router.ingest.config import IngestConfig
from router.ingest.metrics import IngestMetrics
from router.ingest.service import IndexIngest
from router.load.reports import WorkerReportPoller
from router.load.shared import RedisLoadTracker, SharedLoadConfig
from router.routing.policies import make_policy
from router.routing.predicted import PredictedEntries
from router.routing.sessions import SessionTable
from router.routing.share import WorkShares
from router.store.connection import RedisClient, RedisOptions, connect, redact_url
from router.store.layout import KeyLayout
from router.tasks.periodic import Periodic
from router.workers.models import WorkerModels
from router.workers.registration import RegistrationPolicy
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry

__all__ = ["RouterService"]

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_S: Final = 1.0
"""How long a health poll waits for a worker's answer. A poll left unanswered has the proxy
probe at once each request to that worker silent at least this long."""


class RouterService:
    """One router replica; :meth:`open` returns a running one.

    Args:
        config: The replica's configuration (the constructor does no I/O and serves
            nothing: use :meth:`open`).
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.policy_config)
        self.metrics = RouterMetrics()
        self.tokenizer = RequestTokenizer(config.tokenizers, self.metrics.registry)
        self.models = WorkerModels()
        self.breakers = CircuitBreakers(config.breaker, on_open=self._circuit_opened)
        self.metrics.watch_circuits(
            lambda: {r.worker_id: self.breakers.state(r.worker_id) for r in self.workers}
        )
        self.ingest_metrics = IngestMetrics(self.metrics.registry)
        accuracy = RoutingAccuracy(config.accuracy)
        self.metrics.registry.register(AccuracyCollector(accuracy.figures))
        self.sessions = SessionTable(config.sessions) if config.sessions.enabled else None
        self.served = ServedLedger(
            self.metrics, accuracy, self.sessions, ModelLabels(), self._block_size_of
        )
        self.tracing = Tracing.setup(config.otel, required=config.otel_required)
        self.keyer = RouterKeyer(config.key_seed)
        self._predicted = (
            PredictedEntries(self.policy.credit_ttl_s, config.predicted_max_entries)
            if self.policy.credit_ttl_s > 0
            else None
        )
        self._shares = WorkShares(config.policy_config.weights.fair_share_half_life_s)
        self._records: dict[WorkerId, WorkerRecord] = {}
        self._view = WorkerView(self._records, self.models)
        self._routable = RoutableWorkers(
            self._view, self.breakers, lambda wid: self.poller.is_reachable(wid)
        )
        self._decision_log: DecisionLog | None = None
        self._maintainer = Periodic(self.maintain_once, min(1.0, config.lease_ttl_s / 3))
        self.port = config.port
        self.registration = RegistrationPolicy.from_flags(
            config.allow_worker_nets,
            require_curve=config.require_curve,
            own_address=(config.host, config.port) if config.port else None,
        )
        # NOTE: what start() opened, closed in reverse by close(), even after a failure.
        self._stack = contextlib.AsyncExitStack()

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    async def open(cls, config: RouterConfig) -> RouterService:
        """A running replica: connected to Redis, ingesting, serving HTTP on its port.

        The only way to get one: on any failure everything opened so far is closed
        before the error propagates, so a router that cannot start exits instead of
        hanging on what it left open, and no half-built service is ever returned.
        ``async with await RouterService.open(config) as service:`` closes it on exit.

        Raises:
            router.store.connection.RedisConnectError: Redis cannot be reached.
            router.workers.registration.RegistrationError: A configured worker is refused.
            RouterError: The HTTP port cannot be bound, or the configured workers need
                more file descriptors than the process may open
                (:class:`router.ingest.capacity.CapacityError`).
        """
        service = cls(config)
        try:
            await service._start()
        except BaseException:
            await service.close()
            raise
        return service

    async def __aenter__(self) -> RouterService:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> None:
        from router.front.app import make_app  # the HTTP layer imports this module

        cfg = self.config
        raise_fd_limit()  # each worker costs file descriptors (router.ingest.capacity)
        for record in cfg.workers:  # the operator's own workers: refused means misconfigured
            self._admit(record)
        layout = KeyLayout(cfg.namespace)
        stack = self._stack
        self._client: RedisClient = await connect(cfg.redis_url)
        stack.push_async_callback(self._client.aclose)
        # Routing reads go through a client that fails fast: a slow Redis must not stall
        # requests (the ingest's client retries patiently instead); a connection found
        # dead (Redis restarted since it was pooled) is replaced at once, not a failure.
        self._fast_client: RedisClient = await connect(
            cfg.redis_url,
            RedisOptions(socket_timeout_s=cfg.lookup_timeout_s, retries=1, retry_timeouts=False),
        )
        stack.push_async_callback(self._fast_client.aclose)
        logger.info("connected to Redis %s", redact_url(cfg.redis_url))
        self._lookup = IndexLookup(
            RedisPrefixIndex(self._fast_client, layout),
            self.metrics,
            cfg.probe_interval_s,
        )
        # One id names this replica everywhere: its leases ("<epoch>:<id>"), its ingest
        # heartbeat (kvroute index workers' owners) and its shared-load hash.
        replica_id = cfg.replica_id or uuid.uuid4().hex[:12]
        self.registry = WorkerRegistry(
            self._client,
            layout,
            owner=replica_id,
            lease_ttl_ms=int(cfg.lease_ttl_s * 1000),
            policy=self.registration,
            on_invalid=self.metrics.invalid_registrations.inc,
        )
        self.ingest = IndexIngest(
            BridgedIndex(RedisPrefixIndex(self._client, layout), self.keyer),
            self.registry,
            IngestConfig(
                maintain_interval_s=cfg.lease_ttl_s / 3,
                idle_check_s=cfg.event_idle_check_s,
                subscriber=SubscriberConfig(
                    replay_timeout_s=cfg.replay_timeout_s,
                    replay_deadline_s=cfg.replay_deadline_s,
                    liveness=cfg.event_liveness,
                ),
                client_keys=cfg.client_keys,
                worker_admin_key=cfg.worker_admin_key,
            ),
            self.ingest_metrics,
        )
        self.load = RedisLoadTracker(
            self._fast_client,
            SharedLoadConfig(cfg.namespace, replica_id, cfg.lease_ttl_s, cfg.load_refresh_s),
        )
        # No cap on pooled connections: waiting for a free one would hold requests behind
        # unrelated streams (the proxy times the TCP connect alone).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        stack.push_async_callback(self._session.close)
        self.proxy = WorkerProxy(self._session, cfg.proxy, self.breakers)
        self.tokenizer.engine = EngineTokenizer(
            self._session,
            cfg.tokenizers.timeout_s,
            TokenCache(cfg.tokenizers.cache_tokens),
            self.metrics.registry,
        )
        self.poller = WorkerReportPoller(
            self.load,
            self._session,
            cfg.health_poll_s,
            timeout_s=_POLL_TIMEOUT_S,
            on_models=self.models.learn,
            on_silent=lambda wid: self.proxy.suspect(wid, _POLL_TIMEOUT_S),
            on_lifetime=self.ingest.hear_lifetime,
        )
        self._members = WorkerMembership(
            self._records,
            self._view,
            self.registry,
            self.ingest,
            self.poller,
            cfg.dead_after_s or cfg.lease_ttl_s,
            admit=self._admit,
            on_drop=self._forget,
        )
        if cfg.decision_log is not None:
            self._decision_log = DecisionLog(cfg.decision_log)
            stack.callback(self._decision_log.close)
        self._decider = RouteDecider(
            self.policy,
            self.keyer,
            self.metrics,
            self._routable,
            self._lookup,
            self.ingest,
            self.load,
            predicted=self._predicted,
            shares=self._shares,
            sessions=self.sessions,
            decision_log=self._decision_log,
            credit=self.credit,
        )
        stack.push_async_callback(self.load.close)
        await self.load.start()
        self._holds = RouteHolds(self.load, cfg.route_hold_s)
        stack.callback(self._holds.cancel)  # the tracker's close withdraws their load anyway
        stack.push_async_callback(self.ingest.close)
        await self.ingest.start(cfg.workers)
        await self._members.sync()
        stack.push_async_callback(self.poller.close)
        self.poller.start()
        stack.push_async_callback(self._maintainer.stop)
        self._maintainer.start("router-maintenance", wait_first=True)
        # A client that leaves cancels its handler: the request to its worker is closed
        # too, so the worker aborts it (the HTTP layer shields what must not be cut short).
        runner = web.AppRunner(make_app(self), access_log=None, handler_cancellation=True)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        try:
            await web.TCPSite(runner, cfg.host, cfg.port).start()
        except OSError as exc:
            raise RouterError(
                f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}; choose "
                "another --host/--port (port 0 picks a free one) or stop the process that "
                "holds it"
            ) from exc
        self.port = int(runner.addresses[0][1])
        if self.registration.own_address is None:  # port 0: known only now
            self.registration = dataclasses.replace(
                self.registration, own_address=(cfg.host, self.port)
            )
            self.registry.policy = self.registration
        self.metrics.index_live.set(1)
        self.metrics.index_writable.set_function(lambda: 1 if self.index_writable else 0)
        logger.info("router listening on http://%s:%d (policy %s)", cfg.host, self.port, cfg.policy)

    async def close(self) -> None:
        """Stop serving and release everything opened (leases, load, connections).

        Safe after a failed or partial :meth:`start`, and idempotent.
        """
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        await stack.aclose()

    @property
    def url(self) -> str:
        """Base URL of this replica's HTTP API."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def index_live(self) -> bool:
        """False while routing is degraded to load only (lookups fail, or writes do)."""
        return self._lookup.live and self.index_writable

    @property
    def index_writable(self) -> bool:
        """Whether Redis takes the ingest's index writes (see ``IndexIngest.index_writable``)."""
        return self.ingest.index_writable

    @property
    def replica_id(self) -> str:
        """This replica's id (leases, shared load, the hop header)."""
        return self.load.replica_id

    @property
    def index_state(self) -> str:
        """``"live"``; ``"full"`` while Redis refuses index writes for lack of memory;
        ``"degraded"`` while lookups or other writes fail (routing on load alone then)."""
        if self.ingest.index_full:
            return "full"
        return "live" if self.index_live else "degraded"

    async def events_block_sizes(self) -> dict[WorkerId, int]:
        """The workers whose events carry a block size other than their registration's:
        worker id -> that block size, as the replicas holding them recorded in Redis
        (this replica's own knowledge when Redis fails)."""
        flagged = dict(self.ingest.events_block_sizes)
        with contextlib.suppress(*INDEX_ERRORS):
            flagged.update(await self.registry.events_block_sizes(list(self._records)))
        return flagged

    # -- workers -------------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerRecord]:
        """Registered workers, sorted by id."""
        return list(self._view.sorted)

    async def add_worker(self, record: WorkerRecord, *, replace: bool = False) -> Outcome:
        """Register a worker (persisted in Redis) and start ingesting and routing to it
        (see :meth:`router.front.membership.WorkerMembership.add`)."""
        return await self._members.add(record, replace=replace)

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        """Unregister a worker and drop its entries; False when it was not registered."""
        return await self._members.remove(worker_id)

    def _admit(self, record: WorkerRecord) -> None:
        """Refuse a worker this router's policy refuses, or a vLLM worker whose model has
        no tokenizer (:class:`router.workers.registration.RegistrationError`)."""
        self.registration.check(record)
        self.config.tokenizers.check(record)

    def _forget(self, worker_id: WorkerId) -> None:
        """Forget what routing keeps of a worker dropped from the worker set."""
        self.models.forget(worker_id)
        self.breakers.forget(worker_id)
        self.served.accuracy.forget(worker_id)
        self._shares.forget(worker_id)
        if self.sessions is not None:
            self.sessions.forget_worker(worker_id)
        if self._predicted is not None:
            self._predicted.forget(worker_id)

    def _block_size_of(self, worker_id: WorkerId) -> int:
        """A worker's registered block size; 1 (no rounding to blocks) once it is gone."""
        record = self._records.get(worker_id)
        return record.block_size if record is not None else 1

    # -- routing -------------------------------------------------------------------------

    def proxied(self) -> list[WorkerRecord]:
        """Registered workers with an HTTP URL (events-only ones: nowhere to proxy)."""
        return list(self._view.proxied)

    def select_model(self, model: str | None) -> tuple[str | None, Sequence[WorkerRecord]]:
        """The model a request is for and the workers serving it, circuits not considered
        (see :meth:`router.front.candidates.RoutableWorkers.select`, which says what it
        raises)."""
        name, candidates = self._routable.select(model)
        return name, candidates.records

    async def decide(
        self,
        token_ids: Sequence[int],
        num_output_tokens: int,
        *,
        cache_salt: str | None = None,
        record: bool = True,
        model: str | None = None,
        context: RequestContext | None = None,
        session: str | None = None,
    ) -> Routed:
        """Choose a worker for a prompt (see
        :meth:`router.front.decisions.RouteDecider.decide`)."""
        return await self._decider.decide(
            token_ids,
            num_output_tokens,
            cache_salt=cache_salt,
            record=record,
            model=model,
            context=context,
            session=session,
        )

    async def hold(self, routed_: Routed) -> None:
        """Count a ``/v1/route`` decision as load on its worker for ``route_hold_s``."""
        self._holds.hold(routed_)

    def readiness(self) -> Readiness:
        """Whether this replica can serve requests now, and why not."""
        return self._routable.readiness()

    def accounting(self, routed_: Routed) -> LoadAccounting:
        """An observer that accounts a forwarded request's load on each worker tried."""
        return LoadAccounting(self, routed_)

    # -- background ----------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync the worker set, retire dead workers, revive returning ones."""
        self.metrics.shared_load_live.set(1 if self.load.is_shared else 0)
        await self._members.maintain_once()

    def credit(self, worker_id: WorkerId, keys: Sequence[BlockKey]) -> None:
        """Credit a worker with a prefix it is about to compute (predicted entries)."""
        if self._predicted is not None:
            self._predicted.credit(worker_id, keys, time.monotonic())

    def _circuit_opened(self, worker_id: WorkerId) -> None:
        self.metrics.circuit_opens.labels(worker_id).inc()
        logger.warning(
            "worker %s: circuit open, skipped for %.1f s", worker_id, self.config.breaker.cooldown_s
        )
