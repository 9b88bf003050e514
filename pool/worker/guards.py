"""The worker's HTTP guards: bearer keys, JSON-only bodies, and a JSON error for every failure.

Three aiohttp middlewares, outermost first (:func:`guard_middlewares`):

1. **Errors**: every error leaves as ``{"error": {"message", "type"}}``: aiohttp's own
   404/405/413 (the 405 keeps its ``Allow`` header), an engine that has stopped (503
   ``unavailable``), an engine call that timed out (503), and any unexpected exception
   (500 ``internal_error``, logged with its traceback and counted under
   ``kvroute_worker_request_failures_total{reason="handler"}``). A client that closes its
   connection mid-body or mid-response is logged at debug level and counted under
   ``kvroute_worker_client_aborts_total{stage}``: it is no server error.
2. **Keys**: with an admin key, ``POST /v1/reset_prefix_cache`` and ``GET /v1/snapshot``
   need ``Authorization: Bearer <admin key>``; with an API key, ``POST /v1/completions``
   and ``/v1/chat/completions`` need the API key (the admin key also passes). A missing
   or wrong key gets 401 ``authentication_error`` with ``WWW-Authenticate: Bearer``.
   ``/health``, ``/ready``, ``/metrics``, ``/v1/models``, ``/tokenize`` and
   ``/detokenize`` stay open (as vLLM leaves ``/tokenize`` open): probes, scrapers and
   routers carry no key, and none of them reveals a prompt or a cached token.
3. **JSON only**: a POST with a body must say ``Content-Type: application/json``
   (charset, if any, UTF-8), and no POST may carry a type a browser sends cross-site
   without a CORS preflight (form encodings, ``text/plain``), even with an empty body;
   else 415 ``unsupported_media_type``. A web page can then not make a worker act.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from events.auth import BearerKey, challenge
from events.rate_limited_log import RateLimitedLog
from pool.worker.engine import EngineClosedError

__all__ = [
    "ADMIN_PATHS",
    "INFERENCE_PATHS",
    "AccessKeys",
    "error_body",
    "error_response",
    "guard_middlewares",
]

logger = logging.getLogger(__name__)

ADMIN_PATHS: Final = frozenset({"/v1/reset_prefix_cache", "/v1/snapshot"})
"""Routes that change or reveal the cache: behind the admin key."""
INFERENCE_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Routes that run the model: behind the API key."""
_JSON: Final = "application/json"
# The types a cross-site <form> or a no-cors fetch may send without a preflight.
_CORS_SAFELISTED: Final = frozenset(
    {"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"}
)
_REFUSAL_LOG_INTERVAL_S: Final = 60.0


@dataclass(frozen=True)
class AccessKeys:
    """The bearer keys a worker asks for; ``None`` leaves those endpoints open.

    Attributes:
        admin: Guards :data:`ADMIN_PATHS` (and passes on :data:`INFERENCE_PATHS`).
        api: Guards :data:`INFERENCE_PATHS`.
    """

    admin: BearerKey | None = None
    api: BearerKey | None = None

    def required(self, path: str) -> list[BearerKey]:
        """The keys any one of which opens ``path`` (a route's canonical path); empty: open."""
        if path in ADMIN_PATHS:
            return [self.admin] if self.admin is not None else []
        if path in INFERENCE_PATHS and self.api is not None:
            return [self.api] if self.admin is None else [self.api, self.admin]
        return []


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An OpenAI-shaped error body: ``{"error": {"message", "type"}}``."""
    return {"error": {"message": message, "type": kind}}


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-shaped error response with ``status``."""
    return web.json_response(error_body(message, kind), status=status, headers=headers)


def guard_middlewares(
    keys: AccessKeys,
    max_body_bytes: int,
    on_failure: Callable[[str], None],
    on_client_abort: Callable[[str], None],
) -> list[Middleware]:
    """The worker's middlewares, outermost first (see the module docstring).

    Args:
        keys: The bearer keys to ask for.
        max_body_bytes: The body limit, named in 413 messages.
        on_failure: Called with ``"handler"`` for each unexpected exception (a 500).
        on_client_abort: Called with ``"request_body"`` or ``"response"`` when a client
            closes its connection before its request was read or answered.
    """
    refusals = RateLimitedLog(_REFUSAL_LOG_INTERVAL_S, logger)

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _http_error(request, exc, max_body_bytes)
        except ConnectionResetError as exc:
            # Read fully means the client left while being answered, else mid-body.
            stage = "response" if request.content.is_eof() else "request_body"
            logger.debug("client closed the connection (%s) on %s: %s", stage, request.path, exc)
            on_client_abort(stage)
            return error_response(400, "the client closed the connection", "client_closed")
        except EngineClosedError as exc:
            return error_response(503, str(exc), "unavailable")
        except asyncio.TimeoutError:
            return error_response(
                503, "the engine did not answer in time; retry later", "unavailable"
            )
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            on_failure("handler")
            return error_response(
                500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"
            )

    @web.middleware
    async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else ""
        required = keys.required(path)
        header = request.headers.get("Authorization")
        if required and not any(key.accepts(header) for key in required):
            refusals.warning(
                ("unauthorized", path),
                "refused %s %s from %s: missing or wrong bearer key",
                request.method,
                path,
                request.remote,
            )
            which = "admin" if path in ADMIN_PATHS else "API"
            return error_response(
                401,
                f"{path} needs 'Authorization: Bearer KEY' with this worker's {which} key",
                "authentication_error",
                headers={"WWW-Authenticate": challenge(header)},
            )
        return await handler(request)

    @web.middleware
    async def json_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.match_info.http_exception is None:
            problem = _media_type_problem(request)
            if problem is not None:
                return error_response(415, problem, "unsupported_media_type")
        return await handler(request)

    return [errors, bearer, json_only]


def _media_type_problem(request: web.Request) -> str | None:
    """Why a POST's ``Content-Type`` is refused, or ``None`` when it is acceptable."""
    has_type = "Content-Type" in request.headers
    if not has_type:
        if request.body_exists:
            return "a request body needs 'Content-Type: application/json'"
        return None
    media_type = request.content_type  # lower case, parameters stripped
    if media_type == _JSON:
        charset = request.charset
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            return f"JSON bodies must be UTF-8, got charset={charset}"
        return None
    if request.body_exists or media_type in _CORS_SAFELISTED:
        return f"the body must be JSON: send 'Content-Type: application/json', not {media_type!r}"
    return None


def _http_error(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> web.Response:
    """aiohttp's own error (404, 405, 413...) as a JSON one, keeping its headers."""
    headers = {
        name: value
        for name, value in exc.headers.items()
        if name.lower() not in ("content-type", "content-length")
    }
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        message = (
            f"request body exceeds the worker's limit of {max_body_bytes} bytes; "
            "raise it with kvroute worker --max-body-bytes N "
            "(or $KVROUTE_WORKER_MAX_BODY_BYTES)"
        )
        return error_response(413, message, "request_too_large", headers)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
        return error_response(405, message, "method_not_allowed", headers)
    if isinstance(exc, web.HTTPNotFound):
        return error_response(404, f"no endpoint {request.path}", "not_found", headers)
    return error_response(exc.status, exc.text or exc.reason, "invalid_request_error", headers)
