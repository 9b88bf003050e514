"""Workers' own reports: load (``/health`` of kvroute workers, ``/metrics`` of vLLM engines)
and the models they serve (``/v1/models`` of both).

:class:`WorkerReportPoller` polls every worker in the background and hands what each reports
to the :class:`router.load.shared.RedisLoadTracker`, which merges it with the routers' own
counts; a worker that gives no HTTP answer at all is marked unreachable (the service drops
it from routing after a while). A worker whose report stays the same is polled less and less
often, down to once per ``max_interval_s``, or less often in a fleet so large that polls at
rest would pass ``max_polls_per_s`` (:class:`router.tasks.quiet_schedule.QuietSchedule`):
1,000 idle workers cost 25 polls a second instead of 2,000. The lifetime id in the same
answers goes to an ``on_lifetime`` callback, so the ingest need not ask for it again. A
report that changes, or no answer, brings it back to every ``interval_s``. At most
``max_in_flight`` polls run at once, so a large fleet does not time its own polls out. Every
``models_interval_s`` (and first thing for a new worker) it also reads the ``GET
/v1/models`` of the workers whose registration does not name their models, and hands the
entries to an ``on_models`` callback (a vLLM engine lists its LoRA adapters there too, and
loads them at run time). Each poll
that gets no answer is told to ``on_silent`` (the proxy checks its requests waiting on
that worker at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from events.identity import WorkerId
from router.load.model import WorkerLoad
from router.load.shared import RedisLoadTracker
from router.store.connection import gather_bounded
from router.tasks.periodic import Periodic
from router.tasks.quiet_schedule import QuietSchedule
from router.workers.lifetime import process_start_time
from router.workers.models import parse_model_list

__all__ = [
    "LifetimeCallback",
    "ModelsCallback",
    "WorkerReportPoller",
    "parse_health_load",
    "parse_vllm_metrics_load",
]

ModelsCallback = Callable[[WorkerId, list[dict[str, Any]] | None], None]
"""Hears a worker's ``/v1/models`` entries (``None``: it gave no model list)."""
LifetimeCallback = Callable[[WorkerId, str], None]
"""Hears a worker's publisher lifetime id, read from its load report."""

logger = logging.getLogger(__name__)


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def parse_health_load(body: Any) -> WorkerLoad | None:
    """The load in a kvroute worker's ``/health`` JSON, or ``None`` if it has none.

    Accepts the figures at the top level or under ``"load"``: ``running`` and
    ``waiting`` (or ``num_running`` / ``num_waiting``) requests, and optionally
    ``queued_prefill_tokens`` and ``decode_tokens``.
    """
    if not isinstance(body, dict):
        return None
    src = body.get("load") if isinstance(body.get("load"), dict) else body
    assert isinstance(src, dict)
    running = _as_int(src.get("running", src.get("num_running")))
    waiting = _as_int(src.get("waiting", src.get("num_waiting")))
    if running is None and waiting is None:
        return None
    return WorkerLoad(
        (running or 0) + (waiting or 0),
        _as_int(src.get("queued_prefill_tokens")) or 0,
        _as_int(src.get("decode_tokens")) or 0,
    )


def parse_vllm_metrics_load(text: str) -> WorkerLoad | None:
    """The load in a vLLM engine's Prometheus ``/metrics`` text, or ``None`` if absent.

    Sums ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` over their
    label sets (one per model / engine).
    """
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            for sample in family.samples:
                total += sample.value
                found = True
    return WorkerLoad(int(total)) if found else None


class _Report(NamedTuple):
    reachable: bool
    load: WorkerLoad | None
    lifetime: str | None
    """The publisher lifetime id in the same answer (``lifetime_id`` in a kvroute
    worker's ``/health``, ``process_start_time_seconds`` in a vLLM engine's ``/metrics``)."""


class WorkerReportPoller:
    """Polls each worker's own load report and hands it to a :class:`RedisLoadTracker`.

    kvroute workers answer ``GET /health`` with JSON load figures; vLLM engines expose
    ``GET /metrics``. The poller tries ``/health`` and falls back to ``/metrics`` when
    the JSON carries no load. A worker that does not answer reports nothing (its figures
    are dropped, the router's own count stays).

    Args:
        tracker: Where the reports go.
        session: The aiohttp client session to poll with.
        interval_s: Time between two polls of the whole cluster.
        timeout_s: Per-request timeout.
        on_models: Hears each worker's model list when it is read.
        models_interval_s: Time between two reads of one worker's model list.
        on_silent: Hears each worker whose poll got no HTTP answer at all.
        max_interval_s: Longest time between two polls of a worker whose report stays
            the same, in a fleet small enough; a larger one backs off further so that
            polls at rest stay within ``max_polls_per_s``.
        max_in_flight: Most polls at once.
        max_polls_per_s: Polls per second a fleet at rest costs at most.
        on_lifetime: Hears the publisher lifetime id each poll reads (so the ingest
            need not ask for it again).
    """

    def __init__(
        self,
        tracker: RedisLoadTracker,
        session: aiohttp.ClientSession,
        interval_s: float = 0.5,
        timeout_s: float = 1.0,
        on_models: ModelsCallback | None = None,
        models_interval_s: float = 10.0,
        on_silent: Callable[[WorkerId], None] | None = None,
        max_interval_s: float = 8.0,
        max_in_flight: int = 64,
        max_polls_per_s: float = 25.0,
        on_lifetime: LifetimeCallback | None = None,
    ) -> None:
        self._tracker = tracker
        self._on_silent = on_silent
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._on_models = on_models
        self._models_interval_s = models_interval_s
        # NOTE: worker -> monotonic time its model list is due (absent: due now).
        self._models_due: dict[WorkerId, float] = {}
        self._urls: dict[WorkerId, str] = {}
        # NOTE: the polled workers whose models are read (their registration names none).
        self._read_models: set[WorkerId] = set()
        # NOTE: a worker is reachable until a poll of it fails (never polled: reachable).
        self._unreachable: set[WorkerId] = set()
        self._schedule: QuietSchedule[WorkerId] = QuietSchedule(interval_s, max_interval_s)
        self._max_in_flight = max_in_flight
        self._max_interval_s = max_interval_s
        self._max_polls_per_s = max_polls_per_s
        self._on_lifetime = on_lifetime
        self._loop = Periodic(self.poll_once, interval_s)

    def set_worker(self, worker_id: WorkerId, url: str | None, *, models: bool = True) -> None:
        """Start (``url``) or stop (``None``) polling a worker; ``models``: also read its
        model list (not needed when its registration names its models)."""
        self._models_due.pop(worker_id, None)
        self._schedule.forget(worker_id)
        self._read_models.discard(worker_id)
        if url is None:
            self._urls.pop(worker_id, None)
            self._unreachable.discard(worker_id)
            self._tracker.report(worker_id, None)
        else:
            self._urls[worker_id] = url.rstrip("/")
            if models:
                self._read_models.add(worker_id)

    def start(self) -> None:
        """Start polling in the background."""
        self._loop.start("worker-report-poller")

    async def close(self) -> None:
        """Stop polling."""
        await self._loop.stop()

    async def poll_once(self) -> None:
        """Poll the workers that are due, a bounded number at once (and read the model
        lists that are due)."""
        now = time.monotonic()
        urls = self._urls
        # A large fleet backs off further: at rest, at most max_polls_per_s in all.
        self._schedule.max_s = max(self._max_interval_s, len(urls) / self._max_polls_per_s)
        items = [(w, urls[w]) for w in self._schedule.due(urls, now)]
        models = [w for w in self._read_models if self._models_due.get(w, now) <= now]
        limit = self._max_in_flight
        polls, _ = await asyncio.gather(
            gather_bounded((self._poll(url) for _, url in items), limit),
            gather_bounded((self.read_models(w) for w in models), limit),
        )
        now = time.monotonic()
        for (worker_id, _), (reachable, load, lifetime) in zip(items, polls, strict=True):
            if worker_id in self._urls:  # not removed while polling
                self._schedule.observed(worker_id, (load, lifetime), now, healthy=reachable)
                self._tracker.report(worker_id, load)
                if lifetime is not None and self._on_lifetime is not None:
                    self._on_lifetime(worker_id, lifetime)
                if reachable:
                    self._unreachable.discard(worker_id)
                else:
                    self._unreachable.add(worker_id)
                    if self._on_silent is not None:
                        self._on_silent(worker_id)

    async def read_models(self, worker_id: WorkerId) -> None:
        """Read one worker's ``GET /v1/models`` now and hand it to ``on_models`` (not for
        a worker set with ``models=False``)."""
        url = self._urls.get(worker_id)
        if url is None or self._on_models is None or worker_id not in self._read_models:
            return
        self._models_due[worker_id] = time.monotonic() + self._models_interval_s
        entries = None
        try:
            async with self._session.get(f"{url}/v1/models", timeout=self._timeout) as resp:
                if resp.status == 200:
                    entries = parse_model_list(await resp.json(content_type=None))
                else:
                    logger.debug("models of %s unavailable: HTTP %d", url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("models of %s unavailable: %s", url, exc)
        if worker_id in self._urls:  # not removed meanwhile
            self._on_models(worker_id, entries)

    def is_reachable(self, worker_id: WorkerId) -> bool:
        """False when the last poll of the worker got no HTTP answer at all."""
        return worker_id not in self._unreachable

    async def probe(self, url: str) -> bool:
        """True when ``url/health`` gives any HTTP answer."""
        return (await self._poll(url.rstrip("/")))[0]

    async def _poll(self, url: str) -> _Report:
        """Whether the worker answered at all, the load it reports and its lifetime id."""
        reachable = False
        try:
            async with self._session.get(f"{url}/health", timeout=self._timeout) as resp:
                reachable = True
                if resp.status == 200 and resp.content_type == "application/json":
                    body = await resp.json()
                    load = parse_health_load(body)
                    if load is not None:
                        lifetime = body.get("lifetime_id")  # a dict: it has a load
                        return _Report(True, load, lifetime if isinstance(lifetime, str) else None)
            async with self._session.get(f"{url}/metrics", timeout=self._timeout) as resp:
                if resp.status == 200:
                    text = await resp.text()
                    lifetime = process_start_time(text.encode())
                    return _Report(True, parse_vllm_metrics_load(text), lifetime)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("load report of %s unavailable: %s", url, exc)
        return _Report(reachable, None, None)
