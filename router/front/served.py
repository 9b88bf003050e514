"""What the router learns from each request a worker answered: hits, accuracy, latency, sessions.

:class:`RequestTiming` rides along a forwarded request as its attempt observer (wrapping
the load accounting) and notes when the request was dispatched and when each worker's
answer began. Once the answer is out, :meth:`ServedLedger.record` counts it:

* prompt tokens and the cached tokens the worker reported, and the tokens the router
  expected it to hit (:mod:`router.front.accuracy`), per worker;
* time to first token (streams), end-to-end latency and queueing before dispatch, per
  worker and model (:mod:`router.front.model_labels` bounds the model label);
* the session's worker (:mod:`router.routing.sessions`), so the session's next request
  prefers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from events.identity import WorkerId
from router.front.accuracy import RoutingAccuracy, expected_hit_tokens, reported_usage
from router.front.metrics import RouterMetrics
from router.front.model_labels import ModelLabels
from router.front.proxy_contracts import AttemptObserver, AttemptOutcome, ProxyResult, ProxyTarget
from router.routing.policies import Decision
from router.routing.sessions import SessionTable

__all__ = ["RequestTiming", "ServedLedger", "ServedRequest"]


class RequestTiming:
    """An attempt observer that times a request and passes every call on to ``inner``.

    Args:
        inner: The observer doing the real work (load accounting).
        received_s: ``time.perf_counter()`` when the router took the request.
    """

    def __init__(self, inner: AttemptObserver, received_s: float) -> None:
        self._inner = inner
        self.received_s = received_s
        self.dispatched_s: float | None = None
        self.first_byte_s: dict[WorkerId, float] = {}

    async def attempt_started(self, target: ProxyTarget) -> None:
        """Note the first dispatch."""
        if self.dispatched_s is None:
            self.dispatched_s = time.perf_counter()
        await self._inner.attempt_started(target)

    async def first_byte(self, target: ProxyTarget) -> None:
        """Note when ``target``'s answer began (a stream's first event)."""
        self.first_byte_s[target.worker_id] = time.perf_counter()
        await self._inner.first_byte(target)

    async def attempt_ended(self, target: ProxyTarget, outcome: AttemptOutcome) -> None:
        """Pass on."""
        await self._inner.attempt_ended(target, outcome)


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """A forwarded request, as the ledger needs it.

    Attributes:
        decision: The routing decision it was forwarded by.
        num_prompt_tokens: Its prompt length, in the router's tokens.
        result: What the proxy reported.
        timing: Its timing.
        stream: The client asked for a stream.
        model: The body's ``model`` field (``None``: absent).
        session: Its session key, if any.
    """

    decision: Decision
    num_prompt_tokens: int
    result: ProxyResult
    timing: RequestTiming
    stream: bool
    model: object = None
    session: str | None = None


class ServedLedger:
    """Counts what each answered request says about routing and latency.

    Args:
        metrics: Where counters and histograms go.
        accuracy: Per-worker windows of expected against reported hits.
        sessions: Session key -> worker (``None``: affinity off).
        models: The model label's known values.
        block_size_of: A worker's registered block size.
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        accuracy: RoutingAccuracy,
        sessions: SessionTable | None,
        models: ModelLabels,
        block_size_of: Callable[[WorkerId], int],
    ) -> None:
        self.metrics = metrics
        self.accuracy = accuracy
        self.sessions = sessions
        self.models = models
        self._block_size_of = block_size_of

    def record(self, served: ServedRequest) -> None:
        """Count one forwarded request (an answer from some worker, complete or not)."""
        result, timing = served.result, served.timing
        now = time.perf_counter()
        if result.model is not None and result.status == 200:
            self.models.learn(result.model)
        model = self.models.label(served.model)
        if timing.dispatched_s is not None:
            self.metrics.queue_seconds.labels(model).observe(
                timing.dispatched_s - timing.received_s
            )
        if result.status != 200 or result.client_aborted:
            return  # no completion: nothing to learn about hits or latency
        wid = result.worker_id
        self.remember_session(served.session, wid)
        first_byte_s = timing.first_byte_s.get(wid)
        if served.stream and first_byte_s is not None:
            self.metrics.time_to_first_token_seconds.labels(wid, model).observe(
                first_byte_s - timing.received_s
            )
        self.metrics.e2e_request_latency_seconds.labels(wid, model).observe(now - timing.received_s)
        self._hits(served, wid)

    def remember_session(self, session: str | None, worker: WorkerId) -> None:
        """``worker`` serves ``session`` (no-op without a session or with affinity off)."""
        if session is not None and self.sessions is not None:
            self.sessions.record(session, worker, time.monotonic())

    def _hits(self, served: ServedRequest, wid: WorkerId) -> None:
        cached, worker_prompt = reported_usage(served.result.usage)
        self.metrics.prompt_tokens.labels(wid).inc(
            served.num_prompt_tokens if worker_prompt is None else worker_prompt
        )
        now = time.monotonic()
        if cached is None:
            self.metrics.unreported_hits.labels(wid).inc()
            self.accuracy.unreported(wid, now)
            return
        credited = next(
            (c.predicted_tokens for c in served.decision.candidates if c.worker_id == wid), 0
        )
        expected = expected_hit_tokens(credited, served.num_prompt_tokens, self._block_size_of(wid))
        self.metrics.expected_cached_tokens.labels(wid).inc(expected)
        self.metrics.reported_cached_tokens.labels(wid).inc(cached)
        self.accuracy.observe(wid, expected, cached, served.num_prompt_tokens, worker_prompt, now)
