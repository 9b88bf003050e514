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
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Final

import aiohttp
from aiohttp import web

from events.identity import WorkerId
from router.front.breaker import CircuitBreakers
from router.front.hops import HOPS_HEADER
from router.front.proxy_contracts import (
    AttemptObserver,
    AttemptOutcome,
    ProxyConfig,
    ProxyResult,
    ProxyTarget,
    ResponseRewriter,
    WorkersUnavailableError,
)
from router.front.watchdog import SilenceWatchdog
from router.front.worker_answers import (
    SSE,
    WORKER_HEADER,
    Answer,
    AttemptFailed,
    describe,
    read_buffered,
    relay_stream,
)

__all__ = ["WorkerProxy"]

logger = logging.getLogger(__name__)

# The client's Authorization is forwarded only when configured (forward_authorization).
_FORWARDED_HEADERS: Final = ("Accept", "X-Request-Id")
# The body sent is the JSON the router parsed (or rewrote), whatever type the client named;
# kvroute workers refuse a body of any other type.
_BODY_HEADERS: Final = {"Content-Type": "application/json"}


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
            except AttemptFailed as exc:
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

    def _judge(self, worker_id: WorkerId, answer: Answer) -> AttemptOutcome:
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
    ) -> Answer:
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
                if upstream.status == 200 and upstream.content_type == SSE:
                    return await relay_stream(request, upstream, target, observer, rewriter, dog)
                return await read_buffered(
                    upstream, target, observer, rewriter, dog, self.config.max_response_bytes
                )
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
        """The worker's response headers, or :class:`AttemptFailed` with why none came."""
        try:
            return await opening
        except asyncio.CancelledError:
            if dog.verdict is None:
                raise  # the handler itself was cancelled: the client left
            raise AttemptFailed(
                dog.verdict, unreachable=dog.unreachable, timed_out=dog.timed_out
            ) from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as exc:
            # Refused, unreachable, or no connection within the connect timeout.
            raise AttemptFailed(f"cannot connect: {describe(exc)}", unreachable=True) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise AttemptFailed(f"connection lost before answering: {describe(exc)}") from exc
