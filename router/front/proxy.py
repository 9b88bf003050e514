"""Forwards a request to the chosen worker over HTTP, retrying on the next best if it fails first.

The router decides, then :meth:`WorkerProxy.forward` sends the body to the candidates in
order of preference until one answers. A candidate *fails before answering* when the
connection cannot be made, drops, or times out before the response is complete (buffered
responses) or before its headers (streams), or when it answers 502, 503 or 504 (it
cannot serve now). Any other status, 4xx included, is the worker's answer and is passed
back as is. A Server-Sent Events stream is passed through line by line as it arrives;
once its first byte has gone to the client it cannot be retried, so a worker dying
mid-stream ends the client's stream early.

An :class:`AttemptObserver` hears when each attempt starts, gets its first byte and
ends, so the caller can account the worker's load exactly for the time it is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp
import msgspec
from aiohttp import web

from events.identity import WorkerId
from router.errors import RouterError

__all__ = [
    "AttemptObserver",
    "ProxyConfig",
    "ProxyResult",
    "ProxyTarget",
    "ResponseRewriter",
    "WorkerProxy",
    "WorkersUnavailableError",
]

logger = logging.getLogger(__name__)

# The client's Authorization is forwarded only when configured (forward_authorization).
_FORWARDED_HEADERS: Final = ("Accept", "X-Request-Id")
# The body sent is the JSON the router parsed (or rewrote), whatever type the client named;
# kvroute workers refuse a body of any other type.
_BODY_HEADERS: Final = {"Content-Type": "application/json"}
_SSE: Final = "text/event-stream"
WORKER_HEADER: Final = "X-Kvroute-Worker"
"""Response header naming the worker that served a proxied request."""


class WorkersUnavailableError(RouterError):
    """Every candidate failed before answering.

    Attributes:
        failures: One ``"worker: reason"`` line per attempt.
    """

    def __init__(self, failures: Sequence[str]) -> None:
        super().__init__("no worker could serve the request: " + "; ".join(failures))
        self.failures = list(failures)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """How requests are forwarded.

    Attributes:
        connect_timeout_s: Longest wait for a connection to a worker.
        read_timeout_s: Longest silence from a worker once connected (a long prefill or a
            slow stream must fit in it).
        max_attempts: Candidates tried per request, the chosen one included.
        retry_statuses: Worker statuses that mean "cannot serve now": try the next one.
        max_response_bytes: Largest buffered (non-streaming) response accepted.
        forward_authorization: Pass the client's ``Authorization`` header on to the
            worker; off by default, as it holds the client's credentials (the router's
            own key, when it has one) and any worker may be a stranger's.
    """

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    max_attempts: int = 3
    retry_statuses: tuple[int, ...] = (502, 503, 504)
    max_response_bytes: int = 64 * 1024 * 1024
    forward_authorization: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise RouterError(f"max_attempts must be >= 1, got {self.max_attempts}")


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    """A worker to forward to: its id and the base URL of its HTTP API."""

    worker_id: WorkerId
    url: str


@dataclass(slots=True)
class ProxyResult:
    """What happened to a forwarded request.

    Attributes:
        worker_id: The worker whose answer went back to the client.
        status: Its HTTP status.
        num_attempts: Workers tried, the successful one included.
        usage: The ``usage`` object of its completion (last stream chunk or body), if any.
        failures: ``"worker: reason"`` for each failed attempt.
    """

    worker_id: WorkerId
    status: int
    num_attempts: int
    usage: dict[str, object] | None = None
    failures: list[str] = field(default_factory=list)


class AttemptObserver(Protocol):
    """Hears the life of each attempt (used for load accounting)."""

    async def attempt_started(self, target: ProxyTarget) -> None:
        """A request is being sent to ``target``."""
        ...

    async def first_byte(self, target: ProxyTarget) -> None:
        """``target`` started answering (prefill done for streams; all done otherwise)."""
        ...

    async def attempt_ended(self, target: ProxyTarget, ok: bool) -> None:
        """The attempt on ``target`` is over (``ok``: its answer went to the client)."""
        ...


class ResponseRewriter(Protocol):
    """Rewrites a worker's completion answer into another shape (e.g. chat)."""

    def rewrite_body(self, body: bytes) -> bytes:
        """A buffered JSON body."""
        ...

    def rewrite_event(self, data: bytes) -> bytes:
        """The payload of one ``data:`` line of a stream (``[DONE]`` included)."""
        ...


class _Failed(Exception):
    """One attempt failed before anything reached the client."""


class WorkerProxy:
    """Forwards requests to workers with an aiohttp client session.

    Args:
        session: The client session (its connector pools connections per worker).
        config: Timeouts, attempts and limits.
    """

    def __init__(self, session: aiohttp.ClientSession, config: ProxyConfig | None = None) -> None:
        self.config = config or ProxyConfig()
        self._session = session
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.read_timeout_s,
        )

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        targets: Sequence[ProxyTarget],
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None = None,
    ) -> tuple[web.StreamResponse, ProxyResult]:
        """Send ``body`` to ``path`` of the first target that answers; answer the client.

        Args:
            request: The client's request (its response is written here for streams).
            path: Worker path, e.g. ``"/v1/completions"``.
            body: The JSON body to send.
            targets: Candidates in order of preference; at most ``max_attempts`` tried.
            observer: Hears each attempt's start, first byte and end.
            rewriter: Rewrites the answer (``None``: passed through unchanged).

        Returns:
            The response to return from the handler, and what happened.

        Raises:
            WorkersUnavailableError: Every attempt failed before answering.
        """
        names: tuple[str, ...] = _FORWARDED_HEADERS
        if self.config.forward_authorization:
            names = (*names, "Authorization")
        headers = {h: request.headers[h] for h in names if h in request.headers}
        headers.update(_BODY_HEADERS)
        failures: list[str] = []
        for attempt, target in enumerate(targets[: self.config.max_attempts], 1):
            await observer.attempt_started(target)
            ok = False
            try:
                response, usage, status = await self._attempt(
                    request, target, path, body, headers, observer, rewriter
                )
                ok = True
            except _Failed as exc:
                failures.append(f"{target.worker_id}: {exc}")
                logger.warning("worker %s failed before answering: %s", target.worker_id, exc)
                continue
            finally:
                await observer.attempt_ended(target, ok)
            if not response.prepared:
                response.headers[WORKER_HEADER] = target.worker_id
            return response, ProxyResult(target.worker_id, status, attempt, usage, failures)
        raise WorkersUnavailableError(failures or ["no candidate worker"])

    async def _attempt(
        self,
        request: web.Request,
        target: ProxyTarget,
        path: str,
        body: bytes,
        headers: dict[str, str],
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None,
    ) -> tuple[web.StreamResponse, dict[str, object] | None, int]:
        url = target.url.rstrip("/") + path
        try:
            async with self._session.post(
                url, data=body, headers=headers, timeout=self._timeout
            ) as upstream:
                if upstream.status in self.config.retry_statuses:
                    reason = (await upstream.read())[:200].decode(errors="replace")
                    raise _Failed(f"HTTP {upstream.status}: {reason}")
                await observer.first_byte(target)
                if upstream.content_type == _SSE:
                    stream, usage = await self._stream(request, upstream, target, rewriter)
                    return stream, usage, upstream.status
                raw = await self._read_limited(upstream)
                usage = _usage_of(raw)
                if rewriter is not None and upstream.status == 200:
                    raw = rewriter.rewrite_body(raw)
                response = web.Response(
                    body=raw, status=upstream.status, content_type=upstream.content_type
                )
                return response, usage, upstream.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Failed(
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            ) from exc

    async def _read_limited(self, upstream: aiohttp.ClientResponse) -> bytes:
        limit = self.config.max_response_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in upstream.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise _Failed(f"response larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        target: ProxyTarget,
        rewriter: ResponseRewriter | None,
    ) -> tuple[web.StreamResponse, dict[str, object] | None]:
        """Pass an SSE stream through line by line; returns the last ``usage`` seen."""
        response = web.StreamResponse(status=upstream.status)
        response.content_type = _SSE
        response.headers["Cache-Control"] = "no-cache"
        response.headers[WORKER_HEADER] = target.worker_id
        usage: dict[str, object] | None = None
        started = False
        try:
            async for line in upstream.content:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if b'"usage"' in data:
                        usage = _usage_of(data) or usage
                    if rewriter is not None:
                        line = b"data: " + rewriter.rewrite_event(data) + b"\n"
                if not started:
                    await response.prepare(request)
                    started = True
                try:
                    await response.write(line)
                except ConnectionResetError:
                    # The client left: stop reading, which closes the worker's stream too.
                    logger.info("client of worker %s left mid-stream", target.worker_id)
                    return response, usage
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if not started:
                raise _Failed(f"stream broke before its first event: {exc}") from exc
            # Bytes already went to the client: end its stream early, nothing to retry.
            logger.warning("worker %s: stream broke mid-way: %s", target.worker_id, exc)
        if not started:
            await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response, usage


def _usage_of(raw: bytes) -> dict[str, object] | None:
    """The ``usage`` object of a completion body or chunk, if it has one."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else None
