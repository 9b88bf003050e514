"""Who a request is, across hops: its id, its trace, its session.

Every request the router answers gets a :class:`RequestContext`, made from its headers
before anything else runs: the client's ``X-Request-Id`` when it is a usable id (1 to 128
printable ASCII characters), else a fresh one; its W3C ``traceparent`` / ``tracestate``
when well formed (a malformed one is dropped, as the W3C asks). The id goes back in the
response's ``X-Request-Id`` header (errors included), to the worker, and into the
decision log beside the trace id.

The session key of a request is its ``X-Session-Id`` header, else the body's ``user``
field (OpenAI's end-user id), under the same rules as a request id.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from events.request_ids import (
    REQUEST_ID_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    TraceParent,
    new_request_id,
    parse_traceparent,
    printable_id,
    valid_tracestate,
)

__all__ = ["SESSION_HEADER", "RequestContext", "session_key"]

SESSION_HEADER: Final = "X-Session-Id"


@dataclass(slots=True)
class RequestContext:
    """One request's identity and timing.

    Attributes:
        request_id: The client's valid ``X-Request-Id``, or a fresh one.
        traceparent: The client's valid ``traceparent``, if any.
        tracestate: Its valid ``tracestate`` (only with a ``traceparent``).
        received_s: ``time.perf_counter()`` when the router took the request.
        span: The request's OpenTelemetry span while tracing (see
            :mod:`router.front.tracing`), else ``None``.
        trace_id: The trace the request belongs to: the client's, else its span's;
            ``None`` without either.
    """

    request_id: str
    traceparent: TraceParent | None = None
    tracestate: str | None = None
    received_s: float = field(default_factory=time.perf_counter)
    span: Any = None
    trace_id: str | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> RequestContext:
        """The context of a request with these headers (see the module doc)."""
        request_id = printable_id(headers.get(REQUEST_ID_HEADER)) or new_request_id()
        parent = parse_traceparent(headers.get(TRACEPARENT_HEADER))
        state = valid_tracestate(headers.get(TRACESTATE_HEADER)) if parent else None
        return cls(
            request_id, parent, state, trace_id=parent.trace_id if parent is not None else None
        )

    def forwarded_headers(self, traceparent: str | None = None) -> dict[str, str]:
        """Headers that carry the request's identity to a worker.

        Args:
            traceparent: The router's own span as the worker's parent, when tracing;
                else the client's ``traceparent`` goes on unchanged.
        """
        headers = {REQUEST_ID_HEADER: self.request_id}
        if traceparent is None and self.traceparent is not None:
            traceparent = self.traceparent.header
        if traceparent is not None:
            headers[TRACEPARENT_HEADER] = traceparent
            if self.tracestate is not None:
                headers[TRACESTATE_HEADER] = self.tracestate
        return headers


def session_key(headers: Mapping[str, str], user: object = None) -> str | None:
    """A request's session key: its ``X-Session-Id`` header, else the body's ``user``
    field; ``None`` when neither is a usable id."""
    key = printable_id(headers.get(SESSION_HEADER))
    if key is None and isinstance(user, str):
        key = printable_id(user)
    return key
