"""The router's HTTP API (aiohttp): validates requests, asks the service, shapes the answers.

Endpoints:

* ``POST /v1/completions``: OpenAI-style body, ``prompt`` as text (tokenized exactly as
  the workers do) or token ids; routed, then proxied (streams passed through).
* ``POST /v1/chat/completions``: ``messages`` rendered by the chat template into one
  prompt, routed and proxied as a completion, answered in ``chat.completion`` shape.
* ``POST /v1/route``: the decision only, body like ``/v1/completions`` plus optional
  ``"dry_run": true`` (decide and explain, record nothing). Answer: ``{"worker_id",
  "url", "matched_tokens", "candidates": [{"worker_id", "matched_tokens",
  "predicted_tokens", "load", "score"}, ...]}``.
* ``GET /v1/workers`` (each registration plus its ``"circuit": {"state",
  "consecutive_failures", "retry_in_s"}``, and whether its events carry another block
  size than its registration's: ``"block_size_mismatch"``, ``"events_block_size"``);
  ``POST /v1/workers`` (``{"worker_id", "url", "events", "replay", "topic",
  "block_size"}``, optional ``"kind": "vllm"`` and ``"server_key"``, the worker's z85
  CURVE public key for CURVE-secured event streams): 201 when registered, 200 when the
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
the endpoint's key, 404 for an unknown worker or path, 405 for a wrong method, 408 for a
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
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import msgspec
import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from events.errors import EventsError
from events.identity import WorkerId
from events.tokenizer import TokenizerError
from router.front.access import AccessError, Guard
from router.front.chat import ChatMessage, ChatRewriter, ChatTemplateError
from router.front.config import RouterConfig
from router.front.hops import hop_refusal, next_hops
from router.front.identity import answer_request_id, context_of, identify
from router.front.proxy import ResponseRewriter, WorkersUnavailableError
from router.front.request_context import session_key
from router.front.served import RequestTiming, ServedRequest, ask_for_usage
from router.front.service import NoWorkersError, Routed
from router.workers.registration import RegistrationConflict, RegistrationError
from router.workers.registry import WorkerRecord

if TYPE_CHECKING:
    from router.front.service import RouterService

__all__ = ["ChatBody", "CompletionBody", "RouteBody", "WorkerBody", "guards", "make_app"]

logger = logging.getLogger(__name__)

TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]

_SERVICE: Final = web.AppKey("service", object)
_TRACED: Final = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/route"})
_CLIENT_CLOSED: Final = 499  # nginx's "client closed request": no answer was sent
# Sampling fields of a chat request that carry over to the completion sent to the worker.
_CHAT_PASSTHROUGH: Final = (
    "temperature", "top_p", "seed", "stop", "ignore_eos", "stream_options", "model", "n",
)  # fmt: skip


class CompletionBody(msgspec.Struct, kw_only=True):
    """The fields of a completion the router reads (the rest go to the worker untouched)."""

    prompt: str | list[TokenId]
    max_tokens: NonNegative = 16
    stream: bool = False
    cache_salt: str | None = None
    # Read for metrics and session affinity only; any JSON goes on to the worker unjudged.
    model: object = None
    user: object = None


class RouteBody(CompletionBody, kw_only=True):
    """A ``/v1/route`` body: a completion plus ``dry_run``."""

    dry_run: bool = False


class ChatBody(msgspec.Struct, kw_only=True):
    """The fields of a chat completion the router reads."""

    messages: list[ChatMessage]
    max_tokens: NonNegative | None = None
    max_completion_tokens: NonNegative | None = None
    stream: bool = False
    cache_salt: str | None = None
    # Read for metrics and session affinity only; any JSON goes on to the worker unjudged.
    model: object = None
    user: object = None


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


# Record field -> WorkerBody field, where they differ.
_BODY_NAMES: Final = {"http_url": "url", "events_endpoint": "events", "replay_endpoint": "replay"}


class _ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        extra: dict[str, Any] | None = None,
        *,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.extra = extra or {}
        self.close = close


class _ClientGone(Exception):
    """The client closed its connection (``stage``: where the request was)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def _error(
    status: int,
    message: str,
    kind: str,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, **(extra or {})}}
    return web.json_response(body, status=status, headers=headers)


def _decode(raw: bytes, kind: type[Any]) -> Any:
    if not raw.strip():
        raise _ApiError(400, "request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise _ApiError(400, f"invalid request body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise _ApiError(400, f"request body is not valid JSON: {exc}") from exc


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
        )
    )
    return view


class _Handlers:
    """Request handlers bound to one :class:`RouterService`."""

    def __init__(self, service: RouterService) -> None:
        self.svc = service
        self.limits = service.config.limits

    async def _body(self, request: web.Request) -> bytes:
        timeout_s = self.limits.body_read_timeout_s
        try:
            raw = await asyncio.wait_for(request.read(), timeout_s)
        except web.HTTPRequestEntityTooLarge as exc:
            raise _ApiError(
                413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes"
            ) from exc
        except asyncio.TimeoutError as exc:
            raise _ApiError(
                408, f"request body not received within {timeout_s:g} s", "timeout", close=True
            ) from exc
        except ConnectionError as exc:  # the client closed mid-body
            raise _ClientGone("body") from exc
        return raw

    def _check_hops(self, request: web.Request) -> str:
        """The hop header to forward with; 508 for a request that looped back here."""
        replica_id = self.svc.replica_id
        refusal = hop_refusal(request.headers, replica_id)
        if refusal is not None:
            raise _ApiError(508, refusal, "loop_detected")
        return next_hops(request.headers, replica_id)

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                tokens = self.svc.tokenizer.encode(prompt)
            except (TokenizerError, UnicodeError) as exc:
                raise _ApiError(400, f"prompt cannot be tokenized: {exc}") from exc
        else:
            tokens = prompt
        if not tokens:
            raise _ApiError(400, "prompt is empty: send at least one token")
        if len(tokens) > self.limits.max_prompt_tokens:
            raise _ApiError(
                400,
                f"prompt has {len(tokens)} tokens; the limit is {self.limits.max_prompt_tokens}",
            )
        return tokens

    def _check_output(self, max_tokens: int) -> None:
        if max_tokens > self.limits.max_output_tokens:
            raise _ApiError(
                400, f"max_tokens {max_tokens} exceeds the limit {self.limits.max_output_tokens}"
            )

    async def _decide(
        self,
        request: web.Request,
        tokens: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None,
        session: str | None,
        record: bool = True,
    ) -> Routed:
        ctx = context_of(request)
        tracing = self.svc.tracing
        with tracing.child_span(ctx, "kvroute.decide") as span:
            routed = await self.svc.decide(
                tokens, max_tokens, cache_salt=cache_salt, record=record, context=ctx,
                session=session,
            )  # fmt: skip
            if span is not None:  # no attributes built while tracing is off
                chosen = routed.decision.chosen
                tracing.annotate(span, {
                    "kvroute.worker": chosen.worker_id, "kvroute.policy": routed.decision.policy,
                    "kvroute.prompt_tokens": len(tokens),
                    "kvroute.matched_tokens": chosen.matched_tokens,
                    "kvroute.predicted_tokens": chosen.predicted_tokens,
                })  # fmt: skip
        return routed

    async def _proxy(
        self,
        request: web.Request,
        routed: Routed,
        body: bytes,
        rewriter: ResponseRewriter | None = None,
        *,
        hops: str,
        stream: bool,
        model: object,
        session: str | None,
    ) -> web.StreamResponse:
        svc = self.svc
        ctx = context_of(request)
        timing = RequestTiming(svc.accounting(routed), ctx.received_s)
        with svc.tracing.child_span(ctx, "kvroute.proxy") as span:
            headers = ctx.forwarded_headers(svc.tracing.traceparent(span))
            try:
                response, result = await svc.proxy.forward(
                    request, "/v1/completions", body, routed.targets, timing, rewriter,
                    hops=hops, headers=headers,
                )  # fmt: skip
            except WorkersUnavailableError as exc:
                if exc.timed_out:
                    raise _ApiError(504, str(exc), "timeout") from exc
                raise _ApiError(502, str(exc), "worker_unavailable") from exc
            if span is not None:
                svc.tracing.annotate(span, {
                    "kvroute.worker": result.worker_id, "kvroute.attempts": result.num_attempts,
                    "http.response.status_code": result.status,
                })  # fmt: skip
        if result.client_aborted:
            svc.metrics.client_aborts.labels("answer").inc()
        served = ServedRequest(
            routed.decision, routed.num_prompt_tokens, result, timing, stream, model, session
        )
        svc.served.record(served)
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        hops = self._check_hops(request)
        raw = await self._body(request)
        body: CompletionBody = _decode(raw, CompletionBody)
        self._check_output(body.max_tokens)
        tokens = self._tokens(body.prompt)
        session = session_key(request.headers, body.user)
        routed = await self._decide(
            request, tokens, body.max_tokens, cache_salt=body.cache_salt, session=session
        )
        if body.stream:
            raw = msgspec.json.encode(ask_for_usage(msgspec.json.decode(raw)))
        return await self._proxy(
            request, routed, raw, hops=hops, stream=body.stream, model=body.model, session=session
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        hops = self._check_hops(request)
        raw = await self._body(request)
        body: ChatBody = _decode(raw, ChatBody)
        if not body.messages:
            raise _ApiError(400, "messages is empty: send at least one message")
        if len(body.messages) > self.limits.max_messages:
            raise _ApiError(
                400, f"{len(body.messages)} messages; the limit is {self.limits.max_messages}"
            )
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        self._check_output(max_tokens)
        try:
            prompt = self.svc.chat_template.render(body.messages)
        except ChatTemplateError as exc:
            raise _ApiError(400, str(exc)) from exc
        tokens = self._tokens(prompt)
        extra = msgspec.json.decode(raw)
        completion: dict[str, Any] = {k: extra[k] for k in _CHAT_PASSTHROUGH if k in extra}
        completion.update(prompt=prompt, max_tokens=max_tokens, stream=body.stream)
        if body.stream:
            ask_for_usage(completion)
        session = session_key(request.headers, body.user)
        routed = await self._decide(
            request, tokens, max_tokens, cache_salt=body.cache_salt, session=session
        )
        completion_body = msgspec.json.encode(completion)
        return await self._proxy(
            request, routed, completion_body, ChatRewriter(), hops=hops, stream=body.stream,
            model=body.model, session=session,
        )  # fmt: skip

    async def route(self, request: web.Request) -> web.Response:
        body: RouteBody = _decode(await self._body(request), RouteBody)
        self._check_output(body.max_tokens)
        tokens = self._tokens(body.prompt)
        session = session_key(request.headers, body.user)
        routed = await self._decide(
            request, tokens, body.max_tokens, cache_salt=body.cache_salt, session=session,
            record=not body.dry_run,
        )  # fmt: skip
        decision = routed.decision
        if not body.dry_run:
            await self.svc.hold(routed)
            self.svc.served.remember_session(session, decision.worker_id)
        answer = {
            "worker_id": decision.worker_id,
            "url": routed.targets[0].url,
            "matched_tokens": decision.chosen.matched_tokens,
            "candidates": decision.candidates,
        }
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

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
            raise _ApiError(
                400,
                f"worker_id {record.worker_id!r} in the body differs from "
                f"{request.match_info['worker_id']!r} in the path",
            )
        return await self._register(record, replace=True)

    async def _worker_record(self, request: web.Request) -> WorkerRecord:
        body: WorkerBody = _decode(await self._body(request), WorkerBody)
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
            )
        except RegistrationError as exc:
            raise _ApiError(400, f"invalid worker: {exc}") from exc

    async def _register(self, record: WorkerRecord, *, replace: bool) -> web.Response:
        try:
            outcome = await self.svc.add_worker(record, replace=replace)
        except RegistrationConflict as exc:
            raise _ApiError(
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
            raise _ApiError(400, f"invalid worker: {exc}") from exc
        except (RedisError, OSError) as exc:
            raise _ApiError(
                503, f"cannot register now, Redis failed: {exc}; nothing was saved", "unavailable"
            ) from exc
        except (EventsError, zmq.ZMQError) as exc:
            raise _ApiError(
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
            raise _ApiError(
                503, f"cannot unregister now, Redis failed: {exc}", "unavailable"
            ) from exc
        if not known:
            raise _ApiError(404, f"worker {worker_id!r} is not registered", "not_found")
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
        response = _error(405, f"{where}: method not allowed; allowed: {allowed}",
                          "invalid_request_error")  # fmt: skip
        response.headers["Allow"] = allowed
        return response
    if isinstance(exc, web.HTTPNotFound):
        return _error(404, f"{where}: no such endpoint", "invalid_request_error")
    return _error(exc.status, f"{where}: {exc.reason}", "invalid_request_error")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into a JSON error and counts answers per endpoint."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    service: RouterService = request.app[_SERVICE]  # type: ignore[assignment]
    try:
        response = await handler(request)
    except _ApiError as exc:
        response = _error(exc.status, str(exc), exc.kind, exc.extra)
        if exc.close:
            response.force_close()
    except AccessError as exc:
        response = _error(exc.status, str(exc), exc.kind, headers=exc.headers)
    except NoWorkersError as exc:
        response = _error(503, str(exc), "no_workers")
    except web.HTTPException as exc:
        response = _http_error(request, exc)
    except (_ClientGone, asyncio.CancelledError) as exc:
        # The client left (its handler was cancelled, or its body cut): not a failure.
        if isinstance(exc, _ClientGone):
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
        response = _error(500, "internal router error (logged)", "internal_error")
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
    admin, inference = guards(service.config)
    app.add_routes(
        [
            web.post("/v1/completions", inference(h.completions)),
            web.post("/v1/chat/completions", inference(h.chat)),
            web.post("/v1/route", inference(h.route)),
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
