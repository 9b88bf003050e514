"""Request identity across hops: ``X-Request-Id`` and W3C Trace Context headers, validated.

A router and its workers log the same request under the same id: the router takes the
client's ``X-Request-Id`` (or makes one), answers with it and forwards it; a worker echoes
it. ``traceparent`` / ``tracestate`` (W3C Trace Context) are forwarded only when well
formed, so a malformed header from a client never reaches a worker's tracer.

Everything here is pure: header text in, validated values out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_REQUEST_ID_CHARS",
    "REQUEST_ID_HEADER",
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
    "TraceParent",
    "new_request_id",
    "parse_traceparent",
    "printable_id",
    "valid_tracestate",
]

REQUEST_ID_HEADER: Final = "X-Request-Id"
TRACEPARENT_HEADER: Final = "traceparent"
TRACESTATE_HEADER: Final = "tracestate"
MAX_REQUEST_ID_CHARS: Final = 128
"""Longest request id (or session key) taken from a client; a longer one is replaced."""
_MAX_TRACESTATE_CHARS: Final = 512  # the W3C limit
_MAX_TRACESTATE_MEMBERS: Final = 32  # the W3C limit
_PRINTABLE: Final = re.compile(r"[\x20-\x7e]+")
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACESTATE_MEMBER: Final = re.compile(
    r"[a-z0-9][a-z0-9_\-*/@]{0,255}=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}"
)


def printable_id(value: str | None, max_chars: int = MAX_REQUEST_ID_CHARS) -> str | None:
    """``value`` if it is a usable id: 1 to ``max_chars`` printable ASCII characters (space
    included, not at either end); else ``None``.

    Ids go into logs, JSON lines and response headers: control characters (a forged log
    line), non-ASCII text and unbounded lengths are refused rather than escaped.
    """
    if value is None or not 0 < len(value) <= max_chars or value != value.strip():
        return None
    return value if _PRINTABLE.fullmatch(value) else None


def new_request_id() -> str:
    """A fresh request id: 32 lowercase hex digits (random; ``uuid4()`` costs 4x more)."""
    return os.urandom(16).hex()


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid W3C ``traceparent`` header.

    Attributes:
        trace_id: 32 lowercase hex digits, not all zero.
        parent_id: The caller's span id: 16 lowercase hex digits, not all zero.
        flags: The trace flags byte (bit 0: sampled).
    """

    trace_id: str
    parent_id: str
    flags: int

    @property
    def header(self) -> str:
        """The header value (version 00)."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The ``traceparent`` header's fields, or ``None`` when it is absent or malformed.

    Follows the W3C rules: version ``ff`` is invalid; version ``00`` has exactly four
    fields; a later version may append fields after a dash (its first four are read);
    an all-zero trace id or parent id is invalid.
    """
    if value is None:
        return None
    value = value.strip()
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags = match.groups()
    rest = value[match.end() :]
    if version == "ff" or (version == "00" and rest) or (rest and not rest.startswith("-")):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def valid_tracestate(value: str | None) -> str | None:
    """The ``tracestate`` header if well formed (at most 32 ``key=value`` members, 512
    characters), else ``None`` (W3C: a malformed one is dropped, not repaired)."""
    if value is None or len(value) > _MAX_TRACESTATE_CHARS:
        return None
    members = [m.strip() for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > _MAX_TRACESTATE_MEMBERS:
        return None
    if not all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
        return None
    return ",".join(members)
