"""The router service: assembles index, ingest, policy, shared load, proxy and HTTP front.

:class:`RouterService` owns one router replica's life: it connects to Redis, ingests the
registered workers' event streams into the prefix index (:mod:`router.ingest.service`), shares
in-flight load with the other replicas (:mod:`router.load.shared`), decides routes with a
policy (:mod:`router.routing.decider`) and forwards requests (:mod:`router.front.proxy`) behind the
HTTP API of :mod:`router.front.app`.

When the index lookup fails, or Redis refuses the ingest's writes (the index would go
stale), routing degrades to load alone (:mod:`router.front.lookup`): the index never
causes a 5xx. Each forwarded request's load is accounted by :mod:`router.front.load_accounting`;
each worker's failures by its circuit (:mod:`router.front.breaker`), which keeps a failing
worker out of routing decisions for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.subscriber import SubscriberConfig
from router.errors import RouterError
from router.front.accuracy import AccuracyCollector, RoutingAccuracy
from router.front.breaker import CircuitBreakers, CircuitState
from router.front.config import RouterConfig
from router.front.decision_log import DecisionLog
from router.front.engine_tokenizer import EngineTokenizer, TokenCache
from router.front.load_accounting import LoadAccounting
from router.front.lookup import INDEX_ERRORS, IndexLookup
from router.front.metrics import RouterMetrics
from router.front.model_labels import ModelLabels
from router.front.proxy import ProxyTarget, WorkerProxy
from router.front.request_context import RequestContext
from router.front.served import ServedLedger
from router.front.targets import RankedTargets
from router.front.tokenization import RequestTokenizer
from router.front.tracing import Tracing
from router.front.worker_view import CandidateSet, WorkerView
from router.index.base import PrefixMatch
from router.index.redis_index import RedisPrefixIndex
from router.ingest.bridged_index import BridgedIndex
from router.ingest.capacity import raise_fd_limit
from router.ingest.config import IngestConfig
from router.ingest.metrics import IngestMetrics
from router.ingest.service import IndexIngest
from router.load.model import finished, prefilled, routed
from router.load.reports import WorkerReportPoller
from router.load.shared import RedisLoadTracker, SharedLoadConfig
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import (
    CandidateScore,
    Decision,
    RouteRequest,
    make_policy,
)
from router.routing.predicted import PredictedEntries
from router.routing.request_keys import RequestKeys, key_request
from router.routing.sessions import SessionTable
from router.routing.share import WorkShares
from router.store.connection import RedisClient, RedisOptions, connect, redact_url
from router.store.layout import KeyLayout
from router.tasks.periodic import Periodic
from router.workers.liveness import Liveness
from router.workers.models import WorkerModels
from router.workers.registration import RegistrationError, RegistrationPolicy
from router.workers.registry import Outcome, WorkerRecord, WorkerRegistry
from router.workers.registry_watch import RegistryWatch

__all__ = ["NoWorkersError", "Readiness", "Routed", "RouterService"]

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_S: Final = 1.0
"""How long a health poll waits for a worker's answer. A poll left unanswered has the proxy
probe at once each request to that worker silent at least this long."""


class NoWorkersError(RouterError):
    """No worker is registered, or every one's circuit is open: nothing to route to."""


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the replica can serve requests now (``GET /ready``).

    Attributes:
        ready: At least one worker is routable (its circuit is not open and its last
            ``GET /health`` poll got an answer). The index never makes a replica unready:
            it is writable, or routing has degraded to load alone, explicitly.
        reasons: Why it is not ready (empty when ready).
        routable_workers: The routable workers, sorted.
    """

    ready: bool
    reasons: tuple[str, ...]
    routable_workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing decision with what is needed to act on it.

    Attributes:
        decision: The policy's decision and explanation.
        targets: Candidates to forward to, best first (the chosen one first).
        keys: The request's router keys per candidate block size (the worker that
            serves it is credited with those of its size).
        num_prompt_tokens: Prompt length.
        num_output_tokens: Expected output tokens.
        chosen: ``decision.chosen``, found once.
    """

    decision: Decision
    targets: Sequence[ProxyTarget]
    keys: RequestKeys
    num_prompt_tokens: int
    num_output_tokens: int
    chosen: CandidateScore

    def prefill_of(self, worker_id: WorkerId) -> int:
        """Prompt tokens ``worker_id`` is expected to compute for this request."""
        chosen = self.chosen
        if worker_id == chosen.worker_id:  # nearly always: no scan of every candidate
            return max(self.num_prompt_tokens - chosen.predicted_tokens, 0)
        for c in self.decision.candidates:
            if c.worker_id == worker_id:
                return max(self.num_prompt_tokens - c.predicted_tokens, 0)
        return self.num_prompt_tokens


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
        self._liveness = Liveness(config.dead_after_s or config.lease_ttl_s)
        self._decision_log: DecisionLog | None = None
        self._holds: set[asyncio.TimerHandle] = set()
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
            self.registration.check(record)
            cfg.tokenizers.check(record)
        layout = KeyLayout(cfg.namespace)
        stack = self._stack
        self._client: RedisClient = await connect(cfg.redis_url)
        stack.push_async_callback(self._client.aclose)
        # Routing reads go through a client that fails fast: a slow Redis must not stall
        # requests (the ingest's client retries patiently instead).
        self._fast_client: RedisClient = await connect(
            cfg.redis_url, RedisOptions(socket_timeout_s=cfg.lookup_timeout_s, retries=0)
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
        self._registry_watch = RegistryWatch(self.registry)
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
        if cfg.decision_log is not None:
            self._decision_log = DecisionLog(cfg.decision_log)
            stack.callback(self._decision_log.close)
        stack.push_async_callback(self.load.close)
        await self.load.start()
        stack.callback(self._cancel_holds)  # the tracker's close withdraws their load anyway
        stack.push_async_callback(self.ingest.close)
        await self.ingest.start(cfg.workers)
        await self._sync_workers()
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

    def _cancel_holds(self) -> None:
        for handle in self._holds:
            handle.cancel()
        self._holds.clear()

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
        """Register a worker (persisted in Redis) and start ingesting and routing to it.

        The same registration again changes nothing. A different one saved under the
        worker's id (a worker restarted on new endpoints) is replaced only with
        ``replace``: its old entries are dropped and the new stream ingested.

        Returns:
            What happened: ``"created"``, ``"replaced"`` or ``"unchanged"``.

        Its models (unless the registration names them) are read from its ``GET
        /v1/models`` before this returns, so requests for them route to it at once.

        Raises:
            router.workers.registration.RegistrationError: This router's policy refuses it,
                or it is a vLLM worker whose model has no tokenizer.
            router.workers.registration.RegistrationConflict: Another registration is saved
                and ``replace`` is False.
            redis.exceptions.RedisError: Redis is unreachable; nothing was saved.
            events.errors.EventsError: Its event stream cannot be subscribed to.
            router.ingest.capacity.CapacityError: This router holds as many workers as it
                can; nothing was saved.
        """
        self.registration.check(record)
        self.config.tokenizers.check(record)
        wid = record.worker_id
        outcome = await self.ingest.add_worker(record, replace=replace)
        current = self._records.get(wid)
        if current is not None and current != record:
            self._drop_worker(wid)
        self._liveness.forget(wid)
        self._set_worker(record)
        await self.poller.read_models(wid)
        return outcome

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        """Unregister a worker and drop its entries; False when it was not registered."""
        known = worker_id in self._records or self._liveness.is_retired(worker_id)
        saved = await self.ingest.remove_worker(worker_id)
        self._liveness.forget(worker_id)
        self._drop_worker(worker_id)
        return known or saved

    def _set_worker(self, record: WorkerRecord) -> None:
        wid = record.worker_id
        self._records[wid] = record
        self._view.changed()
        self.poller.set_worker(wid, record.http_url, models=not record.models)

    def _drop_worker(self, worker_id: WorkerId) -> None:
        self._records.pop(worker_id, None)
        self._view.changed()
        self.poller.set_worker(worker_id, None)
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

    async def _sync_workers(self) -> None:
        """Adopt registrations made by other replicas (through Redis), when the registry
        changed since the last pass.

        NOTE: a worker missing from Redis is kept: Redis may have restarted empty, and the
        ingest registers its workers again on its next pass.
        """
        for record in await self._registry_watch.changed() or ():
            wid = record.worker_id
            if self._records.get(wid) != record and not self._liveness.is_retired(wid):
                self._set_worker(record)

    # -- routing -------------------------------------------------------------------------

    def proxied(self) -> list[WorkerRecord]:
        """Registered workers with an HTTP URL (events-only ones: nowhere to proxy)."""
        return list(self._view.proxied)

    def select_model(self, model: str | None) -> tuple[str | None, Sequence[WorkerRecord]]:
        """The model a request is for and the workers serving it (see
        :meth:`router.workers.models.WorkerModels.select`), circuits not considered.

        Raises:
            NoWorkersError: No worker with an HTTP URL is registered.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        name, candidates = self._select(model)
        return name, candidates.records

    def _select(self, model: str | None) -> tuple[str | None, CandidateSet]:
        if not self._view.proxied:
            raise NoWorkersError(
                "no worker with an HTTP URL is registered: add one with POST /v1/workers"
            )
        return self._view.select(model)

    def _candidates(self, model: str | None) -> CandidateSet:
        """Workers a new request for ``model`` may go to.

        Raises:
            NoWorkersError: None is registered, or every one's circuit is open.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        _, candidates = self._select(model)
        if self.breakers.all_closed:  # the common case: no per-worker check
            return candidates
        records = candidates.records
        routable = [r for r in records if self._routable(r.worker_id)]
        if not routable:
            raise NoWorkersError(
                "every worker is failing and skipped for now: "
                + "; ".join(self._circuit_text(r.worker_id) for r in records)
            )
        return CandidateSet.of(routable)

    def _routable(self, worker_id: WorkerId) -> bool:
        """Whether new requests may go to the worker: its circuit admits them, and one
        past its cooldown (its trial due) answered the last ``GET /health`` poll, so no
        client's request is the trial of a worker still cut off."""
        if not self.breakers.routable(worker_id):
            return False
        closed = self.breakers.state(worker_id) is CircuitState.CLOSED
        return closed or self.poller.is_reachable(worker_id)

    def _circuit_text(self, worker_id: WorkerId) -> str:
        view = self.breakers.view(worker_id)
        if view.retry_in_s is not None:
            return f"{worker_id} circuit open (next trial in {view.retry_in_s:.1f} s)"
        if view.state is CircuitState.HALF_OPEN and not self.poller.is_reachable(worker_id):
            return f"{worker_id} circuit half_open (no trial before it answers GET /health)"
        return f"{worker_id} circuit {view.state.value} (a trial request is in flight)"

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
        """Choose a worker for a prompt.

        Args:
            token_ids: The prompt's token ids (empty: route on load alone).
            num_output_tokens: Expected output tokens (``max_tokens``).
            cache_salt: The request's cache salt, if any.
            record: Credit predicted entries, count metrics and log the decision (False
                for a dry run, which changes nothing).
            model: The request's ``model``: only workers serving it are candidates.
            context: The request's id and trace (for the decision log).
            session: The request's session key: the worker that served the session last
                gets the session bonus (:mod:`router.routing.sessions`).

        Returns:
            The decision and the forwarding order.

        Raises:
            NoWorkersError: No worker is registered, or every one's circuit is open.
            router.workers.models.ModelNotFoundError: No worker serves ``model``.
            router.workers.models.ModelRequiredError: ``model`` is ``None`` and several
                models are served.
        """
        started = time.perf_counter()
        candidates = self._candidates(model)
        # Keyed once per block size among the candidates, prefixes counted in blocks of
        # the smallest (see router.routing.request_keys): a worker registered with another block
        # size never changes what the others match.
        keyed = key_request(self.keyer, token_ids, candidates.groups, cache_salt)
        workers = candidates.worker_ids
        matches: Mapping[WorkerId, PrefixMatch] = {}
        if self.policy.uses_index and self.index_writable:
            matches = await self._lookup.matches(keyed)
        now = time.monotonic()
        # Only the workers that differ from an idle one holding nothing are gathered (and
        # scored: router.routing.decider), whatever the number of candidates.
        positions = candidates.positions
        predicted = self._predicted_blocks(keyed, positions, now) or {}
        loads = self.load.busy(positions)
        recent = self._shares.recorded(positions, now)
        sessions = self.sessions
        served_last = (
            sessions.worker_of(session, now)
            if session is not None and sessions is not None
            else None
        )
        request = RouteRequest(keyed.base_keys, len(token_ids), keyed.base, num_output_tokens)
        inputs = DecisionInputs(
            request,
            workers,
            loads,
            matches,
            predicted,
            recent,
            session_worker=served_last,
            session_bonus_tokens=sessions.config.bonus_tokens if sessions is not None else 0,
            positions=positions,
        )
        decision = decide(self.policy, inputs)
        targets = RankedTargets(decision, candidates.by_id)
        chosen = decision.chosen
        routed_ = Routed(decision, targets, keyed, len(token_ids), num_output_tokens, chosen)
        if record:
            self.credit(decision.worker_id, keyed.of(decision.worker_id))
            self._shares.add(decision.worker_id, decision.prefill_tokens, now)
            self._record(decision, chosen, len(token_ids), context)
        self.metrics.decision_seconds.labels(decision.policy).observe(time.perf_counter() - started)
        return routed_

    def _predicted_blocks(
        self, keyed: RequestKeys, candidates: Collection[WorkerId], now: float
    ) -> dict[WorkerId, int] | None:
        """Predicted prefix lengths per candidate, in blocks of ``keyed.base`` tokens."""
        if self._predicted is None:
            return None
        out: dict[WorkerId, int] = {}
        groups = keyed.groups
        for size, members in groups.items():
            among = candidates if len(groups) == 1 else set(members)
            found = self._predicted.lookup(keyed.keys[size], among, now)
            if size != keyed.base:
                found = {w: n * size // keyed.base for w, n in found.items()}
            out.update(found)
        return out

    def _record(
        self,
        decision: Decision,
        chosen: CandidateScore,
        num_prompt_tokens: int,
        context: RequestContext | None,
    ) -> None:
        self.metrics.decisions.labels(decision.worker_id, decision.policy).inc()
        self.metrics.matched_tokens.labels(decision.worker_id).inc(chosen.matched_tokens)
        self.metrics.predicted_tokens.labels(decision.worker_id).inc(chosen.predicted_tokens)
        if self._decision_log is not None:
            self._decision_log.write(
                decision,
                num_prompt_tokens,
                index_live=self.index_live,
                request_id=context.request_id if context is not None else None,
                trace_id=context.trace_id if context is not None else None,
            )

    async def hold(self, routed_: Routed) -> None:
        """Count a ``/v1/route`` decision as load on its worker for ``route_hold_s``."""
        wid = routed_.decision.worker_id
        prefill = routed_.prefill_of(wid)
        self.load.add_nowait(wid, routed(prefill, routed_.num_output_tokens))
        release = prefilled(prefill) + finished(routed_.num_output_tokens)

        def expire() -> None:
            self._holds.discard(handle)
            self.load.add_nowait(wid, release)

        # A timer, not a sleeping task per decision: /v1/route is the hot path.
        handle = asyncio.get_running_loop().call_later(self.config.route_hold_s, expire)
        self._holds.add(handle)

    def readiness(self) -> Readiness:
        """Whether this replica can serve requests now, and why not."""
        records = self.proxied()
        if not records:
            return Readiness(False, ("no worker with an HTTP URL is registered",), ())
        routable: list[str] = []
        problems: list[str] = []
        for record in records:
            wid = record.worker_id
            if self.breakers.state(wid) is CircuitState.OPEN:
                problems.append(self._circuit_text(wid))
            elif not self.poller.is_reachable(wid):
                problems.append(f"{wid} gives no answer to GET /health")
            else:
                routable.append(wid)
        if routable:
            return Readiness(True, (), tuple(routable))
        return Readiness(False, ("no routable worker: " + "; ".join(problems),), ())

    def accounting(self, routed_: Routed) -> LoadAccounting:
        """An observer that accounts a forwarded request's load on each worker tried."""
        return LoadAccounting(self, routed_)

    # -- background ----------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync the worker set, retire dead workers, revive returning ones."""
        self.metrics.shared_load_live.set(1 if self.load.is_shared else 0)
        with contextlib.suppress(*INDEX_ERRORS):
            await self._sync_workers()
        live = self._liveness
        for wid in live.overdue(list(self._records), self.poller.is_reachable, time.monotonic()):
            record = self._records[wid]
            logger.warning("worker %s unreachable for %.0fs: dropping it", wid, live.dead_after_s)
            with contextlib.suppress(*INDEX_ERRORS):
                await self.remove_worker(wid)
                live.retire(record)
        for record in live.retired:
            wid = record.worker_id
            if record.http_url and await self.poller.probe(record.http_url):
                logger.info("worker %s answers again: registering it", wid)
                try:
                    await self.add_worker(record)  # no longer retired
                except RegistrationError as exc:  # registered anew meanwhile, or refused
                    logger.info("worker %s stays unregistered: %s", wid, exc)
                    live.forget(wid)
                except INDEX_ERRORS:
                    pass  # retried next pass

    def credit(self, worker_id: WorkerId, keys: Sequence[BlockKey]) -> None:
        """Credit a worker with a prefix it is about to compute (predicted entries)."""
        if self._predicted is not None:
            self._predicted.credit(worker_id, keys, time.monotonic())

    def _circuit_opened(self, worker_id: WorkerId) -> None:
        self.metrics.circuit_opens.labels(worker_id).inc()
        logger.warning(
            "worker %s: circuit open, skipped for %.1f s", worker_id, self.config.breaker.cooldown_s
        )
