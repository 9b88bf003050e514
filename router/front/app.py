"""The router's HTTP API (aiohttp): validates requests, asks the service, shapes the answers.

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (handled by
  :mod:`router.front.openai_api`, as the two below): OpenAI's, routed among the
  workers serving the request's ``model`` and forwarded to the same endpoint as the
  client sent them (byte for byte; a stream is only asked for its usage, which the
  client gets only if it asked: :mod:`router.front.stream_usage`). A prompt is keyed from
  the model's exact token ids (:mod:`router.front.tokenization`); a batch prompt is
  split, each prompt routed on its own prefix, and the answers merged
  (:mod:`router.front.batch`; not streamed). A model no worker serves gets OpenAI's 404
  ``{"error": {"message", "type": "invalid_request_error", "param": null, "code":
  "model_not_found"}}``.
* ``GET /v1/models``: the union of the workers' models (:mod:`router.workers.models`),
  in OpenAI's list shape.
* ``POST /v1/route``: the decision only, body like ``/v1/completions`` (one prompt) plus
  optional ``"dry_run": true`` (decide and explain, record nothing). Answer:
  ``{"worker_id", "url", "matched_tokens", "candidates": [{"worker_id",
  "matched_tokens", "predicted_tokens", "load", "score"}, ...], "num_candidates"}``:
  the best 8 candidates, best first, unless ``?top_k=N`` / ``"top_k": N`` or
  ``?candidates=all`` asks otherwise (:mod:`router.front.route_answer`).
* ``GET /v1/workers`` (each registration plus its ``"circuit": {"state",
  "consecutive_failures", "retry_in_s"}``, and whether its events carry another block
  size than its registration's: ``"block_size_mismatch"``, ``"events_block_size"``);
  ``POST /v1/workers`` (``{"worker_id", "url", "events", "replay", "topic",
  "block_size"}``, optional ``"kind": "vllm"``, ``"models"`` (the model names it serves;
  else read from its ``GET /v1/models``) and ``"server_key"``, the worker's z85 CURVE
  public key for CURVE-secured event streams): 201 when registered, 200 when the
  same registration was already saved, 409 when a different one is; ``PUT
  /v1/workers/{id}`` (same body): registers or replaces, 201 or 200; ``DELETE
  /v1/workers/{id}``. A registration is validated whole
  (:mod:`router.workers.registration`) before anything is saved.
* ``GET /health``: liveness, 200 while the process serves (``"index": "live" | "full" |
  "degraded"``, ``"index_writable"``; ``full``: Redis refuses index writes for lack of
  memory); ``GET /ready``: readiness, 200 ``{"ready": true, ...}`` or 503 ``{"ready":
  false, "reasons": [...], "error"}`` when no worker is routable; ``GET /metrics``.

Every answer carries the request's ``X-Request-Id`` (the client's when usable, else a
fresh one: :mod:`router.front.request_context`), which goes to the worker with a
well-formed ``traceparent``/``tracestate``; inference requests are traced when
:mod:`router.front.tracing` is on. A request's session (``X-Session-Id``, else the body's
``user``) prefers the worker that served it last (:mod:`router.routing.sessions`). Each
answered request is counted by :mod:`router.front.served` (hits, routing accuracy,
latency). Streamed completions are sent with ``stream_options.include_usage``, so vLLM
reports the hit of every request.

Who may call what (bearer keys, JSON-only bodies) is :mod:`router.front.access`. Every
error is JSON ``{"error": {"message", "type"}}``: 400 for a malformed body, 401 without
the endpoint's key, 404 for an unknown worker, model or path, 405 for a wrong method, 408 for a
body not received within its timeout, 409 for a conflicting registration, 413 for a body
above the size limit, 415 for a body not sent as JSON, 502 when no worker could serve,
503 when no worker is registered or every one is failing, 504 when the request ran out of
time, 508 for a request that already passed through this router (a worker URL pointing
at a router: see :mod:`router.front.hops`). A worker's own answer, error or not, is
passed back as is. The prefix index never causes a 5xx: without it the service routes on
load. A client that leaves is counted (``kvroute_router_client_aborts_total``), logged
at debug level and recorded with status 499; its worker request is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from events.errors import EventsError
from events.identity import WorkerId
from router.front.access import AccessError, Guard
from router.front.api_requests import (
    ApiError,
    ClientGone,
    decode_body,
    error_response,
    read_body,
)
from router.front.bodies import CompletionBody, RouteBody
from router.front.candidates import NoWorkersError
from router.front.chat import ChatBody
from router.front.config import RouterConfig
from router.front.identity import answer_request_id, identify
from router.front.openai_api import OpenAIHandlers
from router.ingest.capacity import CapacityError
from router.workers.models import ModelNotFoundError, ModelRequiredError
from router.workers.registration import RegistrationConflict, RegistrationError
from router.workers.registry import WorkerRecord

if TYPE_CHECKING:
    from router.front.service import RouterService

__all__ = ["ChatBody", "CompletionBody", "RouteBody", "WorkerBody", "guards", "make_app"]

logger = logging.getLogger(__name__)

_SERVICE: Final = web.AppKey("service", object)
_TRACED: Final = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/route"})
_CLIENT_CLOSED: Final = 499  # nginx's "client closed request": no answer was sent


class WorkerBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A ``POST``/``PUT /v1/workers`` body (also the shape ``GET /v1/workers`` lists)."""

    worker_id: WorkerId
    url: str
    events: str
    replay: str | None = None
    topic: str = ""
    block_size: int = 16
    kind: Literal["kvroute", "vllm"] = "kvroute"
    server_key: str | None = None
    models: list[str] | None = None


# Record field -> WorkerBody field, where they differ.
_BODY_NAMES: Final = {"http_url": "url", "events_endpoint": "events", "replay_endpoint": "replay"}


def _worker_view(record: WorkerRecord) -> dict[str, Any]:
    """A worker's registration in the shape of a ``POST /v1/workers`` body."""
    view: dict[str, Any] = msgspec.to_builtins(
        WorkerBody(
            worker_id=record.worker_id,
            url=record.http_url or "",
            events=record.events_endpoint,
            replay=record.replay_endpoint,
            topic=record.topic,
            block_size=record.block_size,
            kind=record.kind,
            server_key=record.server_key,
            models=list(record.models) or None,
        )
    )
    return view


class _Handlers:
    """Request handlers bound to one :class:`RouterService`."""

    def __init__(self, service: RouterService) -> None:
        self.svc = service
        self.limits = service.config.limits

    async def list_workers(self, request: web.Request) -> web.Response:
        # Each listed with its circuit, and whether its events carry another block size
        # than registered.
        flagged = await self.svc.events_block_sizes()
        breakers = self.svc.breakers
        workers = [
            {
                **_worker_view(r),
                "circuit": breakers.view(r.worker_id),
                "block_size_mismatch": r.worker_id in flagged,
                "events_block_size": flagged.get(r.worker_id),
            }
            for r in self.svc.workers
        ]
        return web.Response(
            body=msgspec.json.encode({"workers": workers}), content_type="application/json"
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        """``POST /v1/workers``: register a new worker (a different saved one: 409)."""
        record = await self._worker_record(request)
        return await self._register(record, replace=False)

    async def put_worker(self, request: web.Request) -> web.Response:
        """``PUT /v1/workers/{id}``: register a worker, replacing any saved registration."""
        record = await self._worker_record(request)
        if record.worker_id != request.match_info["worker_id"]:
            raise ApiError(
                400,
                f"worker_id {record.worker_id!r} in the body differs from "
                f"{request.match_info['worker_id']!r} in the path",
            )
        return await self._register(record, replace=True)

    async def _worker_record(self, request: web.Request) -> WorkerRecord:
        body: WorkerBody = decode_body(await read_body(request, self.limits), WorkerBody)
        try:
            return WorkerRecord(
                worker_id=body.worker_id,
                events_endpoint=body.events,
                replay_endpoint=body.replay,
                http_url=body.url,
                kind=body.kind,
                block_size=body.block_size,
                topic=body.topic,
                server_key=body.server_key,
                served_models=tuple(body.models or ()),
            )
        except RegistrationError as exc:
            raise ApiError(400, f"invalid worker: {exc}") from exc

    async def _register(self, record: WorkerRecord, *, replace: bool) -> web.Response:
        try:
            outcome = await self.svc.add_worker(record, replace=replace)
        except RegistrationConflict as exc:
            raise ApiError(
                409,
                f"{exc}; to replace it send PUT /v1/workers/{record.worker_id} with the "
                "new registration, or DELETE it first",
                "conflict",
                {
                    "differences": {
                        _BODY_NAMES.get(name, name): {"saved": old, "requested": new}
                        for name, (old, new) in exc.differences.items()
                    }
                },
            ) from exc
        except RegistrationError as exc:
            raise ApiError(400, f"invalid worker: {exc}") from exc
        except (RedisError, OSError) as exc:
            raise ApiError(
                503, f"cannot register now, Redis failed: {exc}; nothing was saved", "unavailable"
            ) from exc
        except (EventsError, zmq.ZMQError, CapacityError) as exc:
            raise ApiError(
                503,
                f"cannot subscribe to the worker's events now: {exc}; nothing was saved",
                "unavailable",
            ) from exc
        status = 201 if outcome == "created" else 200
        return web.json_response(
            {"worker": _worker_view(record), "outcome": outcome}, status=status
        )

    async def remove_worker(self, request: web.Request) -> web.Response:
        worker_id = WorkerId(request.match_info["worker_id"])
        try:
            known = await self.svc.remove_worker(worker_id)
        except (RedisError, OSError) as exc:
            raise ApiError(
                503, f"cannot unregister now, Redis failed: {exc}", "unavailable"
            ) from exc
        if not known:
            raise ApiError(404, f"worker {worker_id!r} is not registered", "not_found")
        return web.json_response({"removed": worker_id})

    async def health(self, request: web.Request) -> web.Response:
        svc = self.svc
        state = svc.index_state
        return web.json_response(
            {
                "status": "ok" if state == "live" else "degraded",
                "index": state,
                "index_writable": svc.index_writable,
                "shared_load": "live" if svc.load.is_shared else "local",
                "policy": svc.policy.name,
                "replica_id": svc.load.replica_id,
                "num_workers": len(svc.workers),
            }
        )

    async def ready(self, request: web.Request) -> web.Response:
        svc = self.svc
        readiness = svc.readiness()
        body: dict[str, Any] = {
            "ready": readiness.ready,
            "reasons": list(readiness.reasons),
            "routable_workers": list(readiness.routable_workers),
            "num_workers": len(svc.workers),
            "index": svc.index_state,
            "index_writable": svc.index_writable,
        }
        if not readiness.ready:
            message = "not ready: " + "; ".join(readiness.reasons)
            body["error"] = {"message": message, "type": "not_ready"}
        return web.json_response(body, status=200 if readiness.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.svc.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own 404/405/413 as JSON errors (a 405 keeps its ``Allow`` header)."""
    where = f"{request.method} {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = error_response(405, f"{where}: method not allowed; allowed: {allowed}",
                          "invalid_request_error")  # fmt: skip
        response.headers["Allow"] = allowed
        return response
    if isinstance(exc, web.HTTPNotFound):
        return error_response(404, f"{where}: no such endpoint", "invalid_request_error")
    return error_response(exc.status, f"{where}: {exc.reason}", "invalid_request_error")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into a JSON error and counts answers per endpoint."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    service: RouterService = request.app[_SERVICE]  # type: ignore[assignment]
    try:
        response = await handler(request)
    except ApiError as exc:
        response = error_response(exc.status, str(exc), exc.kind, exc.extra)
        if exc.close:
            response.force_close()
    except AccessError as exc:
        response = error_response(exc.status, str(exc), exc.kind, headers=exc.headers)
    except NoWorkersError as exc:
        response = error_response(503, str(exc), "no_workers")
    except ModelNotFoundError as exc:  # OpenAI's answer, word for word but the message
        extra = {"param": None, "code": "model_not_found"}
        response = error_response(404, str(exc), "invalid_request_error", extra)
    except ModelRequiredError as exc:
        extra = {"param": "model", "code": None}
        response = error_response(400, str(exc), "invalid_request_error", extra)
    except web.HTTPException as exc:
        response = _http_error(request, exc)
    except (ClientGone, asyncio.CancelledError) as exc:
        # The client left (its handler was cancelled, or its body cut): not a failure.
        if isinstance(exc, ClientGone):
            stage = exc.stage
        else:  # cancelled: the body tells how far the request was
            stage = "answer" if request.content.is_eof() else "body"
        logger.debug("%s %s: the client left (%s)", request.method, request.path, stage)
        service.metrics.client_aborts.labels(stage).inc()
        service.metrics.requests.labels(endpoint, str(_CLIENT_CLOSED)).inc()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return web.Response(status=_CLIENT_CLOSED)  # nobody reads it
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        response = error_response(500, "internal router error (logged)", "internal_error")
    service.metrics.requests.labels(endpoint, str(response.status)).inc()
    return response


def _run_to_completion(handler: Handler) -> Handler:
    """``handler`` finishes even if its client leaves (it changes shared state)."""

    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))

    return run


def make_app(service: RouterService) -> web.Application:
    """The aiohttp application of a router service."""
    app = web.Application(
        middlewares=[identify(lambda: service.tracing, _TRACED), _errors],
        client_max_size=service.config.limits.max_body_bytes,
    )
    app[_SERVICE] = service
    app.on_response_prepare.append(answer_request_id)
    h = _Handlers(service)
    api = OpenAIHandlers(service)
    admin, inference = guards(service.config)
    app.add_routes(
        [
            web.post("/v1/completions", inference(api.completions)),
            web.post("/v1/chat/completions", inference(api.chat)),
            web.post("/v1/route", inference(api.route)),
            web.get("/v1/models", inference(api.models)),
            web.get("/v1/workers", admin(h.list_workers)),
            web.post("/v1/workers", admin(_run_to_completion(h.add_worker))),
            web.put("/v1/workers/{worker_id}", admin(_run_to_completion(h.put_worker))),
            web.delete("/v1/workers/{worker_id}", admin(_run_to_completion(h.remove_worker))),
            web.get("/health", h.health),
            web.get("/ready", h.ready),
            web.get("/metrics", h.metrics),
        ]
    )
    return app


def guards(config: RouterConfig) -> tuple[Guard, Guard]:
    """The admin and inference guards of a router configuration."""
    admin = Guard("admin", "--admin-key", config.admin_key)
    # The admin key opens the inference endpoints too, when they need a key at all.
    inference_keys = () if config.api_key is None else (config.api_key, config.admin_key)
    return admin, Guard("inference", "--api-key", *inference_keys)
