"""Forwards a request to the chosen worker over HTTP, failing over to the next best only when safe.

The router decides, then :meth:`WorkerProxy.forward` sends the body to the candidates in
order of preference. The *first byte of the answer* is the status line of a buffered
answer and the first event of a Server-Sent Events stream (a worker sends a stream's
headers before its prefill). An attempt is **retried** on the next candidate only when the
worker has not answered and nothing went to the client:

* the connection cannot be made (refused, unreachable) or not within ``connect_timeout_s``;
* the connection drops before the first byte of the answer;
* no first byte came for ``first_byte_timeout_s`` and the worker gives no HTTP answer to
  ``GET /health`` within ``connect_timeout_s`` (frozen, or cut off). A worker that answers
  is still working (a long prefill; a buffered answer comes whole, after the completion)
  and is waited on, probed again after each further ``first_byte_timeout_s`` of silence
  (:mod:`router.front.watchdog`). A probe that gets no answer gives up every attempt on
  that worker that has heard nothing from it since the probe began, not only its own: they
  fail over together instead of each waiting out its own silence. The probe comes sooner
  when the router's own health poll of the worker went unanswered (:meth:`WorkerProxy.suspect`):
  a worker cut off is failed over in about the poll's period and timeout + the connect
  timeout, well before the first-byte timeout;
* a 503 that says the worker did not take the request: a ``Retry-After`` header, or a
  JSON error of type ``draining``, ``overloaded`` or ``unavailable`` (what a kvroute
  worker answers while shutting down).

Nothing else is retried. Every other answer is the worker's, passed back as is: a 4xx says
the request is at fault, and a 500 (or any other 5xx) says it failed on the worker, where
a replay could fail, or kill, the next worker too. Once the first byte of a stream has gone
to the client, nothing is retried: a worker failing mid-stream ends the client's stream.
A request is tried on at most ``max_attempts`` workers, within ``total_timeout_s`` in all
(past it the attempt in progress is abandoned). The same silence rule holds mid-answer: a
worker silent for ``first_byte_timeout_s`` that does not answer ``GET /health`` is hung up
on.

Each worker's circuit (:mod:`router.front.breaker`) hears the outcome: an answer below 500 is a
success; a failure before the answer, a 5xx or a broken answer is a failure (one that
shows the worker unreachable opens its circuit at once); a client that left is neither. A
worker whose circuit is open is skipped (it does not count as an attempt).

An :class:`AttemptObserver` hears when each attempt starts, gets its first byte and ends,
so the caller can account the worker's load exactly for the time it is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import aiohttp
import msgspec
from aiohttp import web

from events.auth import SentKey
from events.identity import WorkerId
from router.errors import RouterError
from router.front.breaker import CircuitBreakers
from router.front.hops import HOPS_HEADER
from router.front.stream_usage import NULL_USAGE_TAIL
from router.front.watchdog import SilenceWatchdog

__all__ = [
    "RETRYABLE_503_TYPES",
    "AttemptObserver",
    "AttemptOutcome",
    "ProxyConfig",
    "ProxyResult",
    "ProxyTarget",
    "ResponseRewriter",
    "WorkerProxy",
    "WorkersUnavailableError",
    "worker_refused",
]

logger = logging.getLogger(__name__)

# The client's Authorization is forwarded only when configured (forward_authorization).
_FORWARDED_HEADERS: Final = ("Accept", "X-Request-Id")
# The body sent is the JSON the router parsed (or rewrote), whatever type the client named;
# kvroute workers refuse a body of any other type.
_BODY_HEADERS: Final = {"Content-Type": "application/json"}
_PASSED_BACK_HEADERS: Final = ("Retry-After",)
_SSE: Final = "text/event-stream"
_MAX_REFUSAL_BYTES: Final = 64 * 1024
WORKER_HEADER: Final = "X-Kvroute-Worker"
"""Response header naming the worker that served a proxied request."""
RETRYABLE_503_TYPES: Final = frozenset({"draining", "overloaded", "unavailable"})
"""Error types of a 503 by which a worker says it did not take the request."""

AttemptOutcome = Literal["ok", "failed", "aborted"]
"""How an attempt ended: answered (below 500), failed (the worker's fault), aborted (the
client left)."""


class WorkersUnavailableError(RouterError):
    """No worker's answer can go to the client.

    Attributes:
        failures: One ``"worker: reason"`` line per failed attempt.
        timed_out: The request ran out of its total time.
    """

    def __init__(self, failures: Sequence[str], *, timed_out: bool = False) -> None:
        super().__init__("no worker could serve the request: " + "; ".join(failures))
        self.failures = list(failures)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """How requests are forwarded.

    Attributes:
        connect_timeout_s: Longest wait for a TCP connection to a worker, and for its
            answer to a ``GET /health`` liveness probe.
        first_byte_timeout_s: Silence from a worker (before its first byte, or mid-answer)
            after which it is probed; no answer to the probe gives it up.
        total_timeout_s: Longest time one request may take, every attempt included.
        max_attempts: Workers tried per request, the chosen one included.
        max_response_bytes: Largest buffered (non-streaming) response accepted.
        forward_authorization: Pass the client's ``Authorization`` header on to the
            worker; off by default, as it holds the client's credentials (the router's
            own key, when it has one) and any worker may be a stranger's.
        worker_key: The workers' API key, sent as ``Authorization`` with every forwarded
            request (in place of a forwarded client's).
    """

    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 5.0
    total_timeout_s: float = 600.0
    max_attempts: int = 2
    max_response_bytes: int = 64 * 1024 * 1024
    forward_authorization: bool = False
    worker_key: SentKey | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise RouterError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise RouterError(f"{name} must be > 0, got {value}")


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
        model: The ``model`` its completion names (where ``usage`` was found), if any.
        failures: ``"worker: reason"`` for each failed attempt.
        client_aborted: The client left before the whole answer reached it.
    """

    worker_id: WorkerId
    status: int
    num_attempts: int
    usage: dict[str, object] | None = None
    failures: list[str] = field(default_factory=list)
    client_aborted: bool = False
    model: str | None = None


class AttemptObserver(Protocol):
    """Hears the life of each attempt (used for load accounting)."""

    async def attempt_started(self, target: ProxyTarget) -> None:
        """A request is being sent to ``target``."""
        ...

    async def first_byte(self, target: ProxyTarget) -> None:
        """``target`` started answering (prefill done for streams; all done otherwise)."""
        ...

    async def attempt_ended(self, target: ProxyTarget, outcome: AttemptOutcome) -> None:
        """The attempt on ``target`` is over."""
        ...


class ResponseRewriter(Protocol):
    """Rewrites a worker's answer before it goes to the client (e.g. hides what the router
    asked for its own accounting)."""

    def rewrite_body(self, body: bytes) -> bytes:
        """A buffered JSON body."""
        ...

    def rewrite_event(self, data: bytes) -> bytes | None:
        """The payload of one ``data:`` line of a stream (``[DONE]`` included); ``None``
        drops the event."""
        ...


class _Failed(Exception):
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
class _Answer:
    """An answer that went (or is going) to the client."""

    response: web.StreamResponse
    status: int
    usage: dict[str, object] | None = None
    model: str | None = None
    worker_failed: bool = False  # a 5xx, or a stream the worker broke off
    unreachable: bool = False
    client_aborted: bool = False


def worker_refused(status: int, headers: Mapping[str, str], body: bytes) -> bool:
    """Whether an answer says the worker did not take the request (see the module doc)."""
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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class WorkerProxy:
    """Forwards requests to workers with an aiohttp client session.

    Args:
        session: The client session (its connector pools connections per worker).
        config: Timeouts, attempts and limits.
        breakers: The workers' circuits (a private set by default).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        config: ProxyConfig | None = None,
        breakers: CircuitBreakers | None = None,
    ) -> None:
        self.config = config or ProxyConfig()
        self.breakers = breakers if breakers is not None else CircuitBreakers()
        self._session = session
        # Only the TCP connect is timed by aiohttp: waiting for a pooled connection is not
        # the worker's fault, and silence is the watchdog's (it probes before giving up).
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=self.config.connect_timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
        # NOTE: the watchdogs of the attempts in progress, by worker (none: no key).
        self._watched: dict[WorkerId, set[SilenceWatchdog]] = {}

    async def alive(self, target: ProxyTarget) -> bool:
        """Whether the worker gives any HTTP answer to ``GET /health`` in the connect timeout."""
        try:
            url = target.url.rstrip("/") + "/health"
            async with self._session.get(url, timeout=self._probe_timeout):
                return True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        targets: Sequence[ProxyTarget],
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None = None,
        *,
        hops: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[web.StreamResponse, ProxyResult]:
        """Send ``body`` to ``path`` of the best target that answers; answer the client.

        Args:
            request: The client's request (its response is written here for streams).
            path: Worker path, e.g. ``"/v1/completions"``.
            body: The JSON body to send.
            targets: Candidates in order of preference; at most ``max_attempts`` tried.
            observer: Hears each attempt's start, first byte and end.
            rewriter: Rewrites the answer (``None``: passed through unchanged).
            hops: The ``X-Kvroute-Hops`` value to send (see :mod:`router.front.hops`).
            headers: More headers to send, over the client's (the request's identity:
                ``X-Request-Id``, ``traceparent``).

        Returns:
            The response to return from the handler, and what happened.

        Raises:
            WorkersUnavailableError: No attempt got an answer for the client.
        """
        names: tuple[str, ...] = _FORWARDED_HEADERS
        if self.config.forward_authorization:
            names = (*names, "Authorization")
        sent = {h: request.headers[h] for h in names if h in request.headers}
        if self.config.worker_key is not None:
            sent["Authorization"] = self.config.worker_key.authorization
        sent.update(headers or {})
        sent.update(_BODY_HEADERS)
        if hops is not None:
            sent[HOPS_HEADER] = hops
        deadline = asyncio.get_running_loop().time() + self.config.total_timeout_s
        failures: list[str] = []
        attempts = 0
        for target in targets:
            wid = target.worker_id
            if attempts == self.config.max_attempts:
                break
            if not self.breakers.admit(wid):
                logger.debug("worker %s skipped: its circuit is open", wid)
                continue
            attempts += 1
            await observer.attempt_started(target)
            outcome: AttemptOutcome = "failed"
            try:
                answer = await self._attempt(
                    request, target, path, body, sent, observer, rewriter, deadline
                )
            except _Failed as exc:
                self.breakers.failed(wid, unreachable=exc.unreachable)
                failures.append(f"{wid}: {exc}")
                logger.warning("worker %s failed before answering: %s", wid, exc)
                if not exc.retryable:
                    raise WorkersUnavailableError(failures, timed_out=exc.timed_out) from None
                continue
            except BaseException as exc:  # the client left (handler cancelled), or a bug
                self.breakers.released(wid)
                if isinstance(exc, asyncio.CancelledError):
                    outcome = "aborted"
                raise
            else:
                outcome = self._judge(wid, answer)
            finally:
                await observer.attempt_ended(target, outcome)
            if not answer.response.prepared:
                answer.response.headers[WORKER_HEADER] = wid
            result = ProxyResult(
                wid, answer.status, attempts, answer.usage, failures, answer.client_aborted,
                answer.model,
            )  # fmt: skip
            return answer.response, result
        if not failures:
            failures.append("every candidate worker's circuit is open")
        raise WorkersUnavailableError(failures)

    def _judge(self, worker_id: WorkerId, answer: _Answer) -> AttemptOutcome:
        """Tell the worker's circuit how the attempt went; the attempt's outcome."""
        if answer.worker_failed:
            self.breakers.failed(worker_id, unreachable=answer.unreachable)
            return "failed"
        if answer.client_aborted:
            self.breakers.released(worker_id)
            return "aborted"
        self.breakers.succeeded(worker_id)
        return "ok"

    async def _attempt(
        self,
        request: web.Request,
        target: ProxyTarget,
        path: str,
        body: bytes,
        headers: dict[str, str],
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None,
        deadline: float,
    ) -> _Answer:
        url = target.url.rstrip("/") + path
        opening = asyncio.ensure_future(self._post(url, body, headers))
        dog = SilenceWatchdog(
            window_s=self.config.first_byte_timeout_s,
            deadline=deadline,
            probe=functools.partial(self.alive, target),
            probe_timeout_s=self.config.connect_timeout_s,
            total_timeout_s=self.config.total_timeout_s,
            hang_up=opening.cancel,
            on_dead=functools.partial(self._condemn, target.worker_id),
        )
        watched = self._watched.setdefault(target.worker_id, set())
        watched.add(dog)
        try:
            upstream = await self._opened(opening, dog)
            async with upstream:
                dog.hang_up = upstream.close
                dog.heard()
                if upstream.status == 200 and upstream.content_type == _SSE:
                    return await self._stream(request, upstream, target, observer, rewriter, dog)
                return await self._buffered(upstream, target, observer, rewriter, dog)
        finally:
            dog.stop()
            watched.discard(dog)
            if not watched and self._watched.get(target.worker_id) is watched:
                del self._watched[target.worker_id]

    def suspect(self, worker_id: WorkerId, silent_for_s: float) -> None:
        """Another check found the worker silent: probe now each of its attempts that heard
        nothing from it for ``silent_for_s`` (given up if the probe gets no answer either)."""
        for dog in list(self._watched.get(worker_id, ())):
            dog.check_now(silent_for_s)

    def _condemn(self, worker_id: WorkerId, verdict: str, since: float) -> None:
        """A probe found ``worker_id`` unreachable: give up its other silent attempts."""
        for dog in list(self._watched.get(worker_id, ())):
            dog.condemn(f"{verdict} (found by another request to it)", since)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        return await self._session.post(url, data=body, headers=headers, timeout=self._timeout)

    async def _opened(
        self, opening: asyncio.Future[aiohttp.ClientResponse], dog: SilenceWatchdog
    ) -> aiohttp.ClientResponse:
        """The worker's response headers, or :class:`_Failed` with why none came."""
        try:
            return await opening
        except asyncio.CancelledError:
            if dog.verdict is None:
                raise  # the handler itself was cancelled: the client left
            raise _Failed(
                dog.verdict, unreachable=dog.unreachable, timed_out=dog.timed_out
            ) from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as exc:
            # Refused, unreachable, or no connection within the connect timeout.
            raise _Failed(f"cannot connect: {_describe(exc)}", unreachable=True) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Failed(f"connection lost before answering: {_describe(exc)}") from exc

    def _broken(self, dog: SilenceWatchdog, exc: BaseException, what: str) -> str:
        return dog.verdict if dog.verdict is not None else f"{what}: {_describe(exc)}"

    async def _buffered(
        self,
        upstream: aiohttp.ClientResponse,
        target: ProxyTarget,
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None,
        dog: SilenceWatchdog,
    ) -> _Answer:
        if upstream.status == 503:
            refusal = b""
            with contextlib.suppress(aiohttp.ClientError, _Failed):
                refusal = await self._read_limited(upstream, dog, _MAX_REFUSAL_BYTES)
            if worker_refused(upstream.status, upstream.headers, refusal):
                text = refusal[:200].decode(errors="replace")
                raise _Failed(f"HTTP 503 (not taken): {text}")
            await observer.first_byte(target)
            raw = refusal
        else:
            await observer.first_byte(target)
            try:
                raw = await self._read_limited(upstream, dog, self.config.max_response_bytes)
            except aiohttp.ClientError as exc:
                # The worker answered, then broke off: it did the work; no replay.
                raise _Failed(
                    self._broken(dog, exc, "answer broke off"),
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
        return _Answer(
            response, upstream.status, usage, model, worker_failed=upstream.status >= 500
        )

    async def _read_limited(
        self, upstream: aiohttp.ClientResponse, dog: SilenceWatchdog, limit: int
    ) -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in upstream.content.iter_any():
            dog.heard()
            size += len(chunk)
            if size > limit:
                raise _Failed(f"response larger than {limit} bytes", retryable=False)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        target: ProxyTarget,
        observer: AttemptObserver,
        rewriter: ResponseRewriter | None,
        dog: SilenceWatchdog,
    ) -> _Answer:
        """Pass an SSE stream through line by line, keeping the last ``usage`` seen."""
        try:
            line = await upstream.content.readline()
        except aiohttp.ClientError as exc:
            raise _Failed(
                self._broken(dog, exc, "stream broke before its first event"),
                unreachable=dog.unreachable,
                timed_out=dog.timed_out,
            ) from exc
        if not line:
            raise _Failed("stream ended before its first event")
        dog.heard()
        await observer.first_byte(target)
        response = web.StreamResponse(status=upstream.status)
        response.content_type = _SSE
        response.headers["Cache-Control"] = "no-cache"
        response.headers[WORKER_HEADER] = target.worker_id
        answer = _Answer(response, upstream.status)
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
                self._broken(dog, exc, "connection lost"),
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
