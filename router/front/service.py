"""The router service: assembles index, ingest, policy, shared load, proxy and HTTP front.

:class:`RouterService` owns one router replica's life: it connects to Redis, ingests the
registered workers' event streams into the prefix index (:mod:`router.ingest.service`), shares
in-flight load with the other replicas (:mod:`router.load.shared`), decides routes with a
policy (:mod:`router.routing.decider`) and forwards requests (:mod:`router.front.proxy`) behind the
HTTP API of :mod:`router.front.app`.

When the index lookup fails, routing degrades to load alone (:mod:`router.index.lookup`): the
index never causes a 5xx. Each forwarded request's load is accounted by
:mod:`router.load.accounting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import aiohttp
import msgspec
from aiohttp import web

from events.hashing import BlockKey, RouterKeyer
from events.identity import WorkerId
from events.tokenizer import Tokenizer, load_tokenizer
from router.errors import RouterError
from router.front.chat import ChatTemplate, load_chat_template
from router.front.config import RouterConfig
from router.front.metrics import RouterMetrics
from router.front.proxy import ProxyTarget, WorkerProxy
from router.index.base import PrefixMatch
from router.index.lookup import INDEX_ERRORS, IndexLookup
from router.index.redis_index import RedisPrefixIndex
from router.ingest.metrics import IngestMetrics
from router.ingest.service import IndexIngest, IngestConfig
from router.load.accounting import LoadAccounting
from router.load.model import finished, prefilled, routed
from router.load.shared import RedisLoadTracker, SharedLoadConfig
from router.routing.decider import DecisionInputs, decide
from router.routing.policies import Decision, RouteRequest, make_policy
from router.routing.predicted import PredictedEntries
from router.routing.share import WorkShares
from router.store.connection import RedisClient, RedisOptions, connect
from router.store.layout import KeyLayout
from router.tasks.periodic import Periodic
from router.workers.registry import WorkerRecord, WorkerRegistry
from router.workers.reports import WorkerReportPoller

__all__ = ["NoWorkersError", "Routed", "RouterService"]

logger = logging.getLogger(__name__)


class NoWorkersError(RouterError):
    """No worker is registered (or every one is unreachable): nothing to route to."""


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing decision with what is needed to act on it.

    Attributes:
        decision: The policy's decision and explanation.
        targets: Candidates to forward to, best first (the chosen one first).
        keys: The request's router keys (credited to the worker that serves it).
        num_prompt_tokens: Prompt length.
        num_output_tokens: Expected output tokens.
    """

    decision: Decision
    targets: tuple[ProxyTarget, ...]
    keys: tuple[BlockKey, ...]
    num_prompt_tokens: int
    num_output_tokens: int

    def prefill_of(self, worker_id: WorkerId) -> int:
        """Prompt tokens ``worker_id`` is expected to compute for this request."""
        for c in self.decision.candidates:
            if c.worker_id == worker_id:
                return max(self.num_prompt_tokens - c.predicted_tokens, 0)
        return self.num_prompt_tokens


class RouterService:
    """One router replica.

    Args:
        config: The replica's configuration.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer)
        self.chat_template: ChatTemplate = load_chat_template(config.chat_template)
        self.policy = make_policy(config.policy, config.policy_config)
        self.metrics = RouterMetrics()
        self.ingest_metrics = IngestMetrics(self.metrics.registry)
        self.keyer = RouterKeyer(config.key_seed)
        self._predicted = (
            PredictedEntries(self.policy.credit_ttl_s, config.predicted_max_entries)
            if self.policy.credit_ttl_s > 0
            else None
        )
        self._shares = WorkShares(config.policy_config.weights.fair_share_half_life_s)
        self._records: dict[WorkerId, WorkerRecord] = {}
        self._dead: dict[WorkerId, WorkerRecord] = {}
        self._unreachable_since: dict[WorkerId, float] = {}
        self._suspect_until: dict[WorkerId, float] = {}
        self._decision_log: IO[bytes] | None = None
        self._holds: set[asyncio.TimerHandle] = set()
        self._maintainer = Periodic(self.maintain_once, min(1.0, config.lease_ttl_s / 3))
        self.port = config.port

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> int:
        """Connect to Redis, start ingest, load sharing and the HTTP API; returns the port.

        Raises:
            router.store.connection.RedisConnectError: Redis cannot be reached.
            OSError: The HTTP port cannot be bound.
        """
        from router.front.app import make_app  # the HTTP layer imports this module

        cfg = self.config
        layout = KeyLayout(cfg.namespace)
        self._client: RedisClient = await connect(cfg.redis_url)
        # Routing reads go through a client that fails fast: a slow Redis must not stall
        # requests (the ingest's client retries patiently instead).
        self._fast_client: RedisClient = await connect(
            cfg.redis_url, RedisOptions(socket_timeout_s=cfg.lookup_timeout_s, retries=0)
        )
        self._lookup = IndexLookup(
            RedisPrefixIndex(self._fast_client, layout, self.keyer),
            self.keyer,
            self.metrics,
            cfg.probe_interval_s,
        )
        # One id names this replica everywhere: its leases ("<epoch>:<id>"), its ingest
        # heartbeat (kvroute index workers' owners) and its shared-load hash.
        replica_id = cfg.replica_id or uuid.uuid4().hex[:12]
        self.registry = WorkerRegistry(
            self._client, layout, owner=replica_id, lease_ttl_ms=int(cfg.lease_ttl_s * 1000)
        )
        self.ingest = IndexIngest(
            RedisPrefixIndex(self._client, layout, self.keyer),
            self.registry,
            IngestConfig(maintain_interval_s=cfg.lease_ttl_s / 3, client_keys=cfg.client_keys),
            self.ingest_metrics,
        )
        self.load = RedisLoadTracker(
            self._fast_client,
            SharedLoadConfig(cfg.namespace, replica_id, cfg.lease_ttl_s, cfg.load_refresh_s),
        )
        self._session = aiohttp.ClientSession()
        self.proxy = WorkerProxy(self._session, cfg.proxy)
        self.poller = WorkerReportPoller(self.load, self._session, cfg.health_poll_s)
        if cfg.decision_log is not None:
            self._decision_log = open(cfg.decision_log, "ab")  # noqa: SIM115
        await self.load.start()
        await self.ingest.start(cfg.workers)
        await self._sync_workers()
        self.poller.start()
        self._maintainer.start("router-maintenance", wait_first=True)
        self._runner = web.AppRunner(make_app(self), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.metrics.index_live.set(1)
        logger.info("router listening on http://%s:%d (policy %s)", cfg.host, self.port, cfg.policy)
        return self.port

    async def close(self) -> None:
        """Stop serving and release everything (leases, load, connections)."""
        await self._maintainer.stop()
        if hasattr(self, "_runner"):
            await self._runner.cleanup()
        for handle in self._holds:
            handle.cancel()  # the tracker's close withdraws this replica's load anyway
        await self.poller.close()
        await self.ingest.close()
        await self.load.close()
        await self._session.close()
        await self._client.aclose()
        await self._fast_client.aclose()
        if self._decision_log is not None:
            self._decision_log.close()

    @property
    def url(self) -> str:
        """Base URL of this replica's HTTP API."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def index_live(self) -> bool:
        """False while routing is degraded to load only."""
        return self._lookup.live

    # -- workers -------------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerRecord]:
        """Registered workers, sorted by id."""
        return [self._records[w] for w in sorted(self._records)]

    async def add_worker(self, record: WorkerRecord) -> None:
        """Register a worker (persisted in Redis) and start ingesting and routing to it.

        The same registration again changes nothing; a changed one (a worker restarted on
        new endpoints) replaces it: the old entries are dropped and the new stream ingested.

        Raises:
            redis.exceptions.RedisError: Redis is unreachable.
        """
        wid = WorkerId(record.worker_id)
        current = self._records.get(wid)
        if current == record:
            return
        if current is not None:
            await self.ingest.remove_worker(wid)
            self._drop_worker(wid)
        await self.ingest.add_worker(record)
        self._dead.pop(wid, None)
        self._set_worker(record)

    async def remove_worker(self, worker_id: WorkerId) -> bool:
        """Unregister a worker and drop its entries; False when it was not registered."""
        known = worker_id in self._records or worker_id in self._dead
        await self.ingest.remove_worker(worker_id)
        self._dead.pop(worker_id, None)
        self._drop_worker(worker_id)
        return known

    def _set_worker(self, record: WorkerRecord) -> None:
        wid = WorkerId(record.worker_id)
        self._records[wid] = record
        self.poller.set_worker(wid, record.http_url)

    def _drop_worker(self, worker_id: WorkerId) -> None:
        self._records.pop(worker_id, None)
        self.poller.set_worker(worker_id, None)
        self._shares.forget(worker_id)
        if self._predicted is not None:
            self._predicted.forget(worker_id)

    async def _sync_workers(self) -> None:
        """Adopt registrations made by other replicas (through Redis).

        NOTE: a worker missing from Redis is kept: Redis may have restarted empty, and the
        ingest registers its workers again on its next pass.
        """
        for record in await self.registry.records():
            wid = WorkerId(record.worker_id)
            if self._records.get(wid) != record and wid not in self._dead:
                self._set_worker(record)

    # -- routing -------------------------------------------------------------------------

    def _candidates(self) -> list[WorkerRecord]:
        now = time.monotonic()
        records = [r for r in self.workers if r.http_url]  # events-only: nowhere to proxy
        healthy = [r for r in records if self._suspect_until.get(WorkerId(r.worker_id), 0) <= now]
        return healthy or records

    async def decide(
        self,
        token_ids: Sequence[int],
        num_output_tokens: int,
        *,
        cache_salt: str | None = None,
        record: bool = True,
    ) -> Routed:
        """Choose a worker for a prompt.

        Args:
            token_ids: The prompt's token ids.
            num_output_tokens: Expected output tokens (``max_tokens``).
            cache_salt: The request's cache salt, if any.
            record: Credit predicted entries, count metrics and log the decision (False
                for a dry run, which changes nothing).

        Returns:
            The decision and the forwarding order.

        Raises:
            NoWorkersError: No worker is registered.
        """
        started = time.perf_counter()
        records = self._candidates()
        if not records:
            raise NoWorkersError(
                "no worker with an HTTP URL is registered: add one with POST /v1/workers"
            )
        block_size = records[0].block_size
        keys = self.keyer.keys(token_ids, block_size, cache_salt=cache_salt)
        workers = [WorkerId(r.worker_id) for r in records]
        matches: Mapping[WorkerId, PrefixMatch] = {}
        if self.policy.uses_index:
            matches = await self._lookup.matches(token_ids, records, keys, cache_salt)
        now = time.monotonic()
        predicted = (
            self._predicted.lookup(keys, workers, now) if self._predicted is not None else {}
        )
        loads = await self.load.snapshot(workers)
        recent = self._shares.snapshot(workers, now)
        request = RouteRequest(keys, len(token_ids), block_size, num_output_tokens)
        inputs = DecisionInputs(request, workers, loads, matches, predicted, recent)
        decision = decide(self.policy, inputs)
        by_id = {WorkerId(r.worker_id): r for r in records}
        targets = tuple(
            ProxyTarget(c.worker_id, by_id[c.worker_id].http_url or "") for c in decision.ranked()
        )
        routed_ = Routed(decision, targets, tuple(keys), len(token_ids), num_output_tokens)
        if record:
            self.credit(decision.worker_id, keys)
            self._shares.add(decision.worker_id, decision.prefill_tokens, now)
            self._record(decision, len(token_ids))
        self.metrics.decision_seconds.labels(decision.policy).observe(time.perf_counter() - started)
        return routed_

    def _record(self, decision: Decision, num_prompt_tokens: int) -> None:
        chosen = decision.chosen
        self.metrics.decisions.labels(decision.worker_id, decision.policy).inc()
        self.metrics.matched_tokens.labels(decision.worker_id).inc(chosen.matched_tokens)
        self.metrics.predicted_tokens.labels(decision.worker_id).inc(chosen.predicted_tokens)
        if self._decision_log is not None:
            line = msgspec.json.encode(
                {
                    "ts": time.time(),
                    "worker_id": decision.worker_id,
                    "policy": decision.policy,
                    "num_prompt_tokens": num_prompt_tokens,
                    "index_live": self._lookup.live,
                    "candidates": decision.candidates,
                    "costs": decision.costs,
                    "weights": decision.weights,
                }
            )
            self._decision_log.write(line + b"\n")
            self._decision_log.flush()

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

    def accounting(self, routed_: Routed) -> LoadAccounting:
        """An observer that accounts a forwarded request's load on each worker tried."""
        return LoadAccounting(self, routed_)

    def actual_hits(self, worker_id: WorkerId, usage: Mapping[str, object] | None) -> None:
        """Count the prefix hit the worker reported for a request it served."""
        if not usage:
            return
        cached = usage.get("cached_tokens")
        details = usage.get("prompt_tokens_details")
        if cached is None and isinstance(details, dict):
            cached = details.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            self.metrics.actual_hit_tokens.labels(worker_id).inc(cached)

    # -- background ----------------------------------------------------------------------

    async def maintain_once(self) -> None:
        """Sync the worker set, retire dead workers, revive returning ones."""
        self.metrics.shared_load_live.set(1 if self.load.is_shared else 0)
        with contextlib.suppress(*INDEX_ERRORS):
            await self._sync_workers()
        dead_after = self.config.dead_after_s or self.config.lease_ttl_s
        now = time.monotonic()
        for wid in list(self._records):
            if self.poller.is_reachable(wid):
                self._unreachable_since.pop(wid, None)
            elif now - self._unreachable_since.setdefault(wid, now) >= dead_after:
                record = self._records[wid]
                logger.warning("worker %s unreachable for %.0fs: dropping it", wid, dead_after)
                with contextlib.suppress(*INDEX_ERRORS):
                    await self.remove_worker(wid)
                    self._dead[wid] = record
                    self._unreachable_since.pop(wid, None)
        for wid, record in list(self._dead.items()):
            if record.http_url and await self.poller.probe(record.http_url):
                logger.info("worker %s answers again: registering it", wid)
                with contextlib.suppress(*INDEX_ERRORS):
                    await self.add_worker(record)  # takes it out of _dead

    def credit(self, worker_id: WorkerId, keys: Sequence[BlockKey]) -> None:
        """Credit a worker with a prefix it is about to compute (predicted entries)."""
        if self._predicted is not None:
            self._predicted.credit(worker_id, keys, time.monotonic())

    def mark_suspect(self, worker_id: WorkerId) -> None:
        """Skip a worker that just failed a forwarded request for ``suspect_s``."""
        self._suspect_until[worker_id] = time.monotonic() + self.config.suspect_s
