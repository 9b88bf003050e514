"""The worker's HTTP API (aiohttp): OpenAI completions and chat, models, tokenizer, health, cache.

Handlers run on the asyncio loop and never touch the engine's state directly: requests go
to the engine thread through :meth:`Engine.submit` / :meth:`Engine.call`, and outputs come
back through ``loop.call_soon_threadsafe`` into a per-request queue.

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's (bodies:
  :mod:`pool.worker.completions`; answers and streams: :mod:`pool.worker.responses`; how
  choices run and fail: :mod:`pool.worker.generation`). A ``model`` the worker does not
  serve gets 404 ``{"error": {"message", "type": "invalid_request_error", "param":
  null, "code": "model_not_found"}}``, OpenAI's answer; a parameter it does not support
  (or a harmless one at a value that would change the output) a 400 naming it in
  ``param``.
* ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``: vLLM's shapes
  (:mod:`pool.worker.model_api`).
* ``GET /health``: ``{"status": "ok" | "draining", "worker_id", "lifetime_id", "next_seq",
  "running", "waiting", "free_blocks", "total_blocks", "usage", "queued_prefill_tokens",
  "decode_tokens"}`` (the load figures the router's cost model reads); 503 while draining,
  and 503 ``{"status": "stopped", "worker_id", "lifetime_id"}`` once the engine loop has
  exited. ``lifetime_id`` (32 hex digits, random per worker process) names the publisher
  lifetime: a router that sees it change knows the worker restarted, even when the new
  lifetime's first event batches never reached it. ``next_seq`` is the seq its publisher
  assigns next (every batch below it was published, or dropped on a full queue): a
  router whose stream of the worker went quiet compares it with the last seq it got.
* ``GET /ready``: 200 ``{"status": "ready", "worker_id", "lifetime_id"}`` while the engine
  loop runs and takes requests; 503 ``{"status": "draining" | "stopped", "reason", ...}``
  while draining (after SIGTERM) or once the engine loop has stopped. ``/health`` stays
  the liveness probe.
* ``GET /metrics``: Prometheus text, from the worker's own ``CollectorRegistry``.
* ``POST /v1/reset_prefix_cache``: ``{"success": true}`` (an ``AllBlocksCleared`` event
  is published), or 409 ``{"success": false, "error": {"message", "type": "conflict"}}``
  while requests hold blocks.
* ``GET /v1/snapshot``: every cached block as parent-first runs, each shaped like a
  ``BlockStored`` event::

      {"worker_id": "w0", "lifetime_id": "5f0c...", "block_size": 16,
       "hash_algo": "sha256_cbor", "medium": "GPU", "next_seq": 42,
       "runs": [{"parent_block_hash": null, "block_hashes": [h0, h1],
                 "token_ids": [...32 ids...]}, ...]}

  Hashes are the wire ints of the events (unsigned 64-bit, beyond JavaScript's exact
  range). A run whose blocks are cached in more than one physical copy also has
  ``"copies": [n0, n1, ...]`` (one count per block). The snapshot reflects exactly the
  event batches with seq < ``next_seq``: a router applies it, then the live stream from
  ``next_seq`` on.

Every answer carries back the request's ``X-Request-Id`` (1 to 128 printable ASCII
characters; another value is ignored), and a completion's ``id`` ends with it:
``cmpl-<32 hex digits>-<X-Request-Id>``, unique whatever the client sends.

Errors are JSON ``{"error": {"message", "type"}}``, aiohttp's own included; keys, JSON-only
bodies and error shapes are :mod:`pool.worker.guards`'. A body above the size limit gets
413 ``request_too_large``, the message naming the limit and the flag that raises it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from events.chat_template import BuiltinChatTemplate, ChatTemplate
from events.request_ids import REQUEST_ID_HEADER, printable_id
from events.tokenizer import Tokenizer
from pool.snapshot import new_lifetime_id
from pool.worker.body_fields import CompletionRequestError, ModelNotFoundError
from pool.worker.completions import parse_chat_request, parse_completion_request
from pool.worker.engine import Engine, EngineClosedError
from pool.worker.generation import Generation
from pool.worker.guards import AccessKeys, error_body, guard_middlewares
from pool.worker.model_api import ModelAPI
from pool.worker.outputs import EngineStats
from pool.worker.responses import AnswerShape

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MODEL_NAME", "WorkerHTTP", "WorkerInfo"]

logger = logging.getLogger(__name__)

_ENGINE_TIMEOUT_S: Final = 30.0
DEFAULT_MODEL_NAME: Final = "kvroute-tiny"
"""The name a worker with random weights serves under (``--served-model-name``)."""
DEFAULT_MAX_BODY_BYTES: Final = 8 * 1024 * 1024
T = TypeVar("T")
FAILURE_REASONS: Final = ("forward", "sampling", "engine", "engine_stopped", "handler")
"""Labels of ``kvroute_worker_request_failures_total``: the engine's failure stages (see
:class:`~pool.worker.outputs.RequestFailure`), requests cut off by the engine loop stopping, and
unexpected errors in an HTTP handler."""
CLIENT_ABORT_STAGES: Final = ("request_body", "response")
"""Labels of ``kvroute_worker_client_aborts_total``: when the client closed its connection."""


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker says about itself.

    Attributes:
        worker_id: The worker's id in the cluster.
        served_model_names: The model names it answers to (``--served-model-name``); the
            first is the ``model`` of answers to requests that name none.
        hash_algo: The block hash algorithm of its events.
        medium: The ``medium`` of its events.
        lifetime_id: Names this process's publisher lifetime (its seqs start at 0); a
            fresh random one by default, so build one ``WorkerInfo`` per worker process.
    """

    worker_id: str
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    hash_algo: str = "sha256_cbor"
    medium: str = "GPU"
    lifetime_id: str = field(default_factory=new_lifetime_id)


class _EngineCollector(Collector):
    """Exposes the engine's gauges and counters as of the last scrape, and request failures.

    Failures come from two counts: the engine's (by stage) and the HTTP layer's own
    (``engine_stopped``, ``handler``), merged under one family.
    """

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.http_failures: collections.Counter[str] = collections.Counter()

    def collect(self) -> list[Metric]:
        failures = CounterMetricFamily(
            "kvroute_worker_request_failures",
            "Requests that failed on the worker (a JSON 500 or 503), by reason.",
            labels=["reason"],
        )
        engine_failures = self.stats.num_failures if self.stats is not None else {}
        for reason in FAILURE_REASONS:
            count = engine_failures.get(reason, 0) + self.http_failures[reason]
            failures.add_metric([reason], count)
        s = self.stats
        if s is None:
            return [failures]
        return [
            failures,
            _gauge("kvroute_worker_requests_running", "Requests running.", s.num_running),
            _gauge("kvroute_worker_requests_waiting", "Requests waiting.", s.num_waiting),
            _gauge("kvroute_worker_free_blocks", "Free KV blocks.", s.num_free_blocks),
            _gauge("kvroute_worker_kv_cache_usage_ratio", "Fraction of KV blocks in use.", s.usage),
            _gauge(
                "kvroute_worker_queued_prefill_tokens",
                "Prompt tokens still to compute (waiting misses, running prefill chunks).",
                s.queued_prefill_tokens,
            ),
            _gauge(
                "kvroute_worker_decode_tokens",
                "Tokens still to generate by running and waiting requests, at most.",
                s.decode_tokens,
            ),
            _counter(
                "kvroute_worker_prefix_query_tokens",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_query_tokens,
            ),
            _counter(
                "kvroute_worker_prefix_hit_tokens",
                "Prompt tokens found in the prefix cache.",
                s.prefix_hit_tokens,
            ),
            _counter("kvroute_worker_preemptions", "Requests preempted.", s.num_preemptions),
            _counter(
                "kvroute_worker_event_batches_published",
                "KV event batches handed to the publisher.",
                s.num_batches_published,
            ),
            _counter(
                "kvroute_worker_event_batches_dropped",
                "KV event batches dropped (publisher queue full).",
                s.num_batches_dropped,
            ),
        ]


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer carries the request's ``X-Request-Id`` back, when it had a usable one."""
    request_id = printable_id(request.headers.get(REQUEST_ID_HEADER))
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id


class WorkerHTTP:
    """The aiohttp application of one worker.

    Args:
        engine: The started engine.
        tokenizer: Turns text prompts into ids and ids into text.
        info: Identity of the worker.
        max_body_bytes: Largest request body accepted; larger ones get a JSON 413.
        keys: The bearer keys asked for (none by default).
        chat_template: Renders chat messages (the built-in template by default).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        info: WorkerInfo,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        keys: AccessKeys | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.chat_template = chat_template or BuiltinChatTemplate()
        self.registry = CollectorRegistry()
        self._collector = _EngineCollector()
        self.registry.register(self._collector)
        self.step_seconds = Histogram(
            "kvroute_worker_step_seconds",
            "Duration of one engine step.",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
        )
        engine.step_observer = self.step_seconds.observe
        self._generation = Generation(engine, tokenizer, self.registry, self._count_failure)
        self._models = ModelAPI(
            info.served_model_names,
            tokenizer,
            self.chat_template,
            engine.max_request_tokens,
            engine.model.config.vocab_size,
        )
        self._client_aborts = Counter(
            "kvroute_worker_client_aborts",
            "Requests whose client closed the connection before the end, by stage.",
            ["stage"],
            registry=self.registry,
        )
        for stage in CLIENT_ABORT_STAGES:
            self._client_aborts.labels(stage)
        middlewares = guard_middlewares(
            keys or AccessKeys(),
            max_body_bytes,
            on_failure=self._count_failure,
            on_client_abort=lambda stage: self._client_aborts.labels(stage).inc(),
        )
        self.app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
        self.app.on_response_prepare.append(_echo_request_id)
        self.app.add_routes(
            [
                web.post("/v1/completions", _request_errors(self._completions)),
                web.post("/v1/chat/completions", _request_errors(self._chat)),
                web.get("/v1/models", self._models.models),
                web.post("/tokenize", _request_errors(self._models.tokenize)),
                web.post("/detokenize", _request_errors(self._models.detokenize)),
                web.get("/health", self._health),
                web.get("/ready", self._ready),
                web.get("/metrics", self._metrics),
                web.post("/v1/reset_prefix_cache", self._reset),
                web.get("/v1/snapshot", self._snapshot),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port).

        Returns:
            The port in effect.
        """
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Close the listener and the open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self.engine.call(fn)), _ENGINE_TIMEOUT_S)

    # ------------------------------------------------------------------ handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion_request(
            await request.read(), self.tokenizer, self.info.served_model_names
        )
        shape = AnswerShape(
            "completion", parsed.model, self.tokenizer, parsed.include_usage, _client_id(request)
        )
        return await self._generation.serve(request, parsed, shape)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat_request(
            await request.read(),
            self.tokenizer,
            self.chat_template,
            self.info.served_model_names,
            self.engine.max_request_tokens,
        )
        shape = AnswerShape(
            "chat", parsed.model, self.tokenizer, parsed.include_usage, _client_id(request)
        )
        return await self._generation.serve(request, parsed, shape)

    def _count_failure(self, reason: str) -> None:
        self._collector.http_failures[reason] += 1

    async def _health(self, request: web.Request) -> web.Response:
        stats = None
        if self.engine.is_running:
            with contextlib.suppress(EngineClosedError):  # it stopped since
                stats = await self._on_engine(self.engine.stats)
        if stats is None:
            stopped = {
                "status": "stopped",
                "worker_id": self.info.worker_id,
                "lifetime_id": self.info.lifetime_id,
            }
            return web.json_response(stopped, status=503)
        accepting = self.engine.is_accepting
        body = {
            "status": "ok" if accepting else "draining",
            "worker_id": self.info.worker_id,
            "lifetime_id": self.info.lifetime_id,
            "next_seq": stats.num_batches_published + stats.num_batches_dropped,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "free_blocks": stats.num_free_blocks,
            "total_blocks": stats.num_usable_blocks,
            "usage": stats.usage,
            "queued_prefill_tokens": stats.queued_prefill_tokens,
            "decode_tokens": stats.decode_tokens,
        }
        return web.json_response(body, status=200 if accepting else 503)

    async def _ready(self, request: web.Request) -> web.Response:
        engine = self.engine
        identity = {"worker_id": self.info.worker_id, "lifetime_id": self.info.lifetime_id}
        if not engine.is_running:
            reason = engine.failure or "the engine loop has stopped"
            return web.json_response(
                {"status": "stopped", "reason": reason, **identity}, status=503
            )
        if not engine.is_accepting:
            reason = "the worker is draining: it finishes its requests and takes no new ones"
            return web.json_response(
                {"status": "draining", "reason": reason, **identity}, status=503
            )
        return web.json_response({"status": "ready", **identity})

    async def _metrics(self, request: web.Request) -> web.Response:
        # With the engine stopped, the last figures it gave stay (its failures included).
        with contextlib.suppress(EngineClosedError):
            self._collector.stats = await self._on_engine(self.engine.stats)
        return web.Response(
            body=generate_latest(self.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _reset(self, request: web.Request) -> web.Response:
        if await self._on_engine(self.engine.reset_prefix_cache):
            return web.json_response({"success": True})
        message = "requests are running and hold KV blocks; retry when the worker is idle"
        return web.json_response({"success": False, **error_body(message, "conflict")}, status=409)

    async def _snapshot(self, request: web.Request) -> web.Response:
        snap = await self._on_engine(self.engine.snapshot)
        info = self.info
        body = {
            "worker_id": info.worker_id,
            "lifetime_id": info.lifetime_id,
            "block_size": snap.block_size,
            "hash_algo": info.hash_algo,
            "medium": info.medium,
            "next_seq": snap.next_seq,
            "runs": snap.runs,
        }
        return web.json_response(body)


def _client_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id`` when it is a printable id (else none)."""
    return printable_id(request.headers.get(REQUEST_ID_HEADER))


def _request_errors(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``handler`` with its request errors answered as OpenAI does: 400 naming the
    parameter, 404 ``model_not_found`` for a model not served."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ModelNotFoundError as exc:
            body = error_body(str(exc))
            body["error"].update(param=None, code="model_not_found")
            return web.json_response(body, status=404)
        except CompletionRequestError as exc:
            body = error_body(str(exc))
            body["error"].update(param=exc.param, code=None)
            return web.json_response(body, status=400)

    return answer
