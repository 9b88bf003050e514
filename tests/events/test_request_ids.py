"""Request ids and W3C trace context headers: what is taken, what is refused."""

from __future__ import annotations

import re

import pytest

from events.request_ids import (
    TraceParent,
    new_request_id,
    parse_traceparent,
    printable_id,
    valid_tracestate,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        ("abc-123", True),
        ("req 42/with:punctuation!", True),
        ("x" * 128, True),
        ("x" * 129, False),  # too long
        ("", False),
        (None, False),
        (" padded", False),  # surrounding space: not what the client meant to send
        ("line\nbreak", False),  # a forged log line
        ("tab\there", False),
        ("caf\u00e9", False),  # not ASCII
        ("\x7f", False),  # DEL
    ],
)
def test_printable_id(value: str | None, taken: bool) -> None:
    assert printable_id(value) == (value if taken else None)


def test_new_request_ids_are_unique_hex() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_traceparent_parsed_and_written_back() -> None:
    parent = parse_traceparent(f"00-{TRACE}-{SPAN}-01")
    assert parent == TraceParent(TRACE, SPAN, 1)
    assert parent.header == f"00-{TRACE}-{SPAN}-01"
    # A later version may append fields: the first four are read, written as version 00.
    later = parse_traceparent(f"01-{TRACE}-{SPAN}-00-extra")
    assert later == TraceParent(TRACE, SPAN, 0)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"01-{TRACE}-{SPAN}-01extra",
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE.upper()}-{SPAN}-01",  # uppercase hex
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short
        "garbage",
    ],
)
def test_malformed_traceparent_is_dropped(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_tracestate() -> None:
    assert valid_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7") == (
        "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )
    assert valid_tracestate("tenant@vendor=v") == "tenant@vendor=v"
    for bad in (None, "", "novalue", "Upper=1", "a=1,b", "a=x" + "y" * 600, "a=b=c"):
        assert valid_tracestate(bad) is None, bad
    assert valid_tracestate(",".join(f"k{i}=v" for i in range(33))) is None
