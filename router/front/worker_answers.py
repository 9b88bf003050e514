"""Passes a worker's answer on to the client: a buffered body read whole, or a stream relayed.

A buffered answer is read within a size bound (a 503 by which the worker says it did not
take the request, :func:`worker_refused`, fails the attempt instead); a Server-Sent Events
stream is relayed line by line as it comes, through the caller's
:class:`router.front.proxy_contracts.ResponseRewriter`. Either way the completion's
``usage`` and ``model`` are read on the way, and the attempt's
:class:`router.front.watchdog.SilenceWatchdog` hears every byte. What goes wrong before
anything reached the client is an :class:`AttemptFailed`, which
:class:`router.front.proxy.WorkerProxy` may retry on the next worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from router.front.proxy_contracts import AttemptObserver, ProxyTarget, ResponseRewriter
from router.front.stream_usage import NULL_USAGE_TAIL
from router.front.watchdog import SilenceWatchdog

__all__ = [
    "RETRYABLE_503_TYPES",
    "SSE",
    "WORKER_HEADER",
    "Answer",
    "AttemptFailed",
    "describe",
    "read_buffered",
    "relay_stream",
    "worker_refused",
]

logger = logging.getLogger(__name__)

_PASSED_BACK_HEADERS: Final = ("Retry-After",)
SSE: Final = "text/event-stream"
"""The content type of a Server-Sent Events stream."""
_MAX_REFUSAL_BYTES: Final = 64 * 1024
WORKER_HEADER: Final = "X-Kvroute-Worker"
"""Response header naming the worker that served a proxied request."""
RETRYABLE_503_TYPES: Final = frozenset({"draining", "overloaded", "unavailable"})
"""Error types of a 503 by which a worker says it did not take the request."""


class AttemptFailed(Exception):
    """An attempt failed with nothing sent to the client.

    Attributes:
        retryable: The next candidate may be tried (the worker sent no answer).
        unreachable: The worker could not be reached at all (its circuit opens at once).
        timed_out: The request's total time ran out.
    """

    def __init__(
        self,
        reason: str,
        *,
        retryable: bool = True,
        unreachable: bool = False,
        timed_out: bool = False,
    ) -> None:
        super().__init__(reason)
        self.retryable = retryable and not timed_out
        self.unreachable = unreachable
        self.timed_out = timed_out


@dataclass(slots=True)
class Answer:
    """An answer that went (or is going) to the client."""

    response: web.StreamResponse
    status: int
    usage: dict[str, object] | None = None
    model: str | None = None
    worker_failed: bool = False  # a 5xx, or a stream the worker broke off
    unreachable: bool = False
    client_aborted: bool = False


def worker_refused(status: int, headers: Mapping[str, str], body: bytes) -> bool:
    """Whether an answer says the worker did not take the request (the 503s
    :mod:`router.front.proxy` retries)."""
    if status != 503:
        return False
    if "Retry-After" in headers:
        return True
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return isinstance(error, dict) and error.get("type") in RETRYABLE_503_TYPES


def describe(exc: BaseException) -> str:
    """``exc`` in a failure reason: its type, and its message when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _broken(dog: SilenceWatchdog, exc: BaseException, what: str) -> str:
    return dog.verdict if dog.verdict is not None else f"{what}: {describe(exc)}"


async def read_buffered(
    upstream: aiohttp.ClientResponse,
    target: ProxyTarget,
    observer: AttemptObserver,
    rewriter: ResponseRewriter | None,
    dog: SilenceWatchdog,
    max_response_bytes: int,
) -> Answer:
    """Read a buffered answer whole (at most ``max_response_bytes``) into the client's
    response; a 503 by which the worker says it did not take the request fails the
    attempt (retryable)."""
    if upstream.status == 503:
        refusal = b""
        with contextlib.suppress(aiohttp.ClientError, AttemptFailed):
            refusal = await _read_limited(upstream, dog, _MAX_REFUSAL_BYTES)
        if worker_refused(upstream.status, upstream.headers, refusal):
            text = refusal[:200].decode(errors="replace")
            raise AttemptFailed(f"HTTP 503 (not taken): {text}")
        await observer.first_byte(target)
        raw = refusal
    else:
        await observer.first_byte(target)
        try:
            raw = await _read_limited(upstream, dog, max_response_bytes)
        except aiohttp.ClientError as exc:
            # The worker answered, then broke off: it did the work; no replay.
            raise AttemptFailed(
                _broken(dog, exc, "answer broke off"),
                retryable=False,
                unreachable=dog.unreachable,
                timed_out=dog.timed_out,
            ) from exc
    usage, model = _usage_of(raw)
    if rewriter is not None and upstream.status == 200:
        raw = rewriter.rewrite_body(raw)
    status, content_type = upstream.status, upstream.content_type
    response = web.Response(body=raw, status=status, content_type=content_type)
    for name in _PASSED_BACK_HEADERS:
        if name in upstream.headers:
            response.headers[name] = upstream.headers[name]
    return Answer(response, upstream.status, usage, model, worker_failed=upstream.status >= 500)


async def _read_limited(
    upstream: aiohttp.ClientResponse, dog: SilenceWatchdog, limit: int
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in upstream.content.iter_any():
        dog.heard()
        size += len(chunk)
        if size > limit:
            raise AttemptFailed(f"response larger than {limit} bytes", retryable=False)
        chunks.append(chunk)
    return b"".join(chunks)


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    target: ProxyTarget,
    observer: AttemptObserver,
    rewriter: ResponseRewriter | None,
    dog: SilenceWatchdog,
) -> Answer:
    """Pass an SSE stream through line by line, keeping the last ``usage`` seen."""
    try:
        line = await upstream.content.readline()
    except aiohttp.ClientError as exc:
        raise AttemptFailed(
            _broken(dog, exc, "stream broke before its first event"),
            unreachable=dog.unreachable,
            timed_out=dog.timed_out,
        ) from exc
    if not line:
        raise AttemptFailed("stream ended before its first event")
    dog.heard()
    await observer.first_byte(target)
    response = web.StreamResponse(status=upstream.status)
    response.content_type = SSE
    response.headers["Cache-Control"] = "no-cache"
    response.headers[WORKER_HEADER] = target.worker_id
    answer = Answer(response, upstream.status)
    await response.prepare(request)
    dropped = False  # the event just dropped: its blank line goes too
    try:
        while line:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                # A chunk ending in "usage":null has none: not decoded at all.
                if b'"usage"' in data and not data.endswith(NULL_USAGE_TAIL):
                    usage, model = _usage_of(data)
                    if usage is not None:
                        answer.usage, answer.model = usage, model
                if rewriter is not None:
                    rewritten = rewriter.rewrite_event(data)
                    dropped = rewritten is None
                    line = b"" if rewritten is None else b"data: " + rewritten + b"\n"
            elif dropped and not line.strip():
                line, dropped = b"", False
            try:
                if line:
                    await response.write(line)
            except ConnectionResetError:
                # The client left: leaving this block closes the worker's stream too,
                # so the worker aborts the request.
                logger.debug("client of worker %s left mid-stream", target.worker_id)
                answer.client_aborted = True
                return answer
            line = await upstream.content.readline()
            dog.heard()
    except aiohttp.ClientError as exc:
        # Bytes already went to the client: end its stream early, nothing to retry.
        answer.worker_failed = True
        answer.unreachable = dog.unreachable
        logger.warning(
            "worker %s: stream broke mid-way: %s",
            target.worker_id,
            _broken(dog, exc, "connection lost"),
        )
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return answer


class _Reported(msgspec.Struct):
    """The fields of a completion the router reads (the rest is skipped, not decoded)."""

    usage: Any = None
    model: Any = None


_reported = msgspec.json.Decoder(_Reported)


def _usage_of(raw: bytes) -> tuple[dict[str, object] | None, str | None]:
    """The ``usage`` object of a completion body or chunk, and its ``model``, if any."""
    try:
        # Only usage and model become Python objects: the choices' text is skipped.
        body = _reported.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):  # not JSON, or not an object
        return None, None
    usage, model = body.usage, body.model
    return (
        usage if isinstance(usage, dict) else None,
        model if isinstance(model, str) else None,
    )
