"""The middleware that gives each request its identity and, while tracing, its server span.

Every request gets a :class:`router.front.request_context.RequestContext` before any
handler runs (so errors carry it too), readable with :func:`context_of`; requests to the
traced paths run inside their ``kvroute.request`` server span
(:mod:`router.front.tracing`); :func:`answer_request_id` writes the request's id on
every answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from events.request_ids import REQUEST_ID_HEADER
from router.front.request_context import RequestContext
from router.front.tracing import Tracing

__all__ = ["answer_request_id", "context_of", "identify"]

_CONTEXT: Final = web.RequestKey("kvroute_context", RequestContext)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def context_of(request: web.Request) -> RequestContext:
    """The request's context (set by the :func:`identify` middleware)."""
    return request[_CONTEXT]


def identify(tracing: Callable[[], Tracing], traced: Collection[str]) -> Middleware:
    """The middleware: a context for every request; a server span for the ``traced`` paths.

    Args:
        tracing: The replica's tracing now (it may be swapped while serving).
        traced: Paths whose requests get a span (the inference endpoints).
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        ctx = RequestContext.from_headers(request.headers)
        request[_CONTEXT] = ctx
        if request.path not in traced:
            return await handler(request)
        spans = tracing()
        with spans.request_span(ctx, f"{request.method} {request.path}") as span:
            response = await handler(request)
            spans.annotate(span, {"http.response.status_code": response.status})
            return response

    return middleware


async def answer_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: every answer names its request (``X-Request-Id``),
    errors included."""
    ctx = request.get(_CONTEXT)
    if ctx is not None:
        response.headers[REQUEST_ID_HEADER] = ctx.request_id
