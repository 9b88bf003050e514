"""OpenTelemetry spans of a real router, caught by the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.front.request_context import RequestContext
from router.front.tracing import Tracing, TracingError, wants_tracing
from tests.support.router_app import JSON, echo_workers, running_router

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from tests.support.paths import REPO_ROOT as ROOT

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def hex_id(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


def test_spans_of_decide_and_proxy_hang_under_the_clients_trace(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = tmp_path / "decisions.jsonl"

    async def scenario() -> list[dict[str, str]]:
        async with (
            echo_workers(1) as (worker,),
            running_router(redis_url, namespace, [worker], decision_log=str(log)) as (svc, client),
        ):
            svc.tracing = Tracing.with_provider(provider)
            body = {"prompt": "hello", "max_tokens": 1}
            headers = {**JSON, "traceparent": f"00-{TRACE}-{PARENT}-01", "X-Request-Id": "t1"}
            async with client.post("/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
            async with client.post("/v1/completions", json=body, headers=JSON) as resp:
                assert resp.status == 200
                lines.append(resp.headers["X-Request-Id"])
            return worker.headers

    lines: list[str] = []
    sent = asyncio.run(scenario())
    untraced_id = lines[0]
    spans: list[ReadableSpan] = list(exporter.get_finished_spans())
    assert [s.name for s in spans] == [
        "kvroute.decide", "kvroute.proxy", "POST /v1/completions",
    ] * 2  # fmt: skip
    decide, proxy, request = spans[:3]
    # The request span is the client's child; decide and proxy are the request span's.
    assert request.parent is not None and hex_id(request.parent.span_id, 16) == PARENT
    assert request.parent.is_remote
    for span in (decide, proxy, request):
        assert hex_id(span.context.trace_id, 32) == TRACE
        assert span.attributes is not None and span.attributes["kvroute.request_id"] == "t1"
    for span in (decide, proxy):
        assert span.parent is not None and span.parent.span_id == request.context.span_id
    assert decide.attributes is not None and decide.attributes["kvroute.worker"] == "w0"
    assert proxy.attributes is not None and proxy.attributes["http.response.status_code"] == 200
    # The worker got the proxy span as its parent.
    assert sent[0]["traceparent"] == f"00-{TRACE}-{hex_id(proxy.context.span_id, 16)}-01"
    # Without a client trace the router starts one, forwards it and logs it.
    _, second_proxy, root = spans[3:]
    assert root.parent is None
    root_trace = hex_id(root.context.trace_id, 32)
    assert sent[1]["traceparent"].startswith(
        f"00-{root_trace}-{hex_id(second_proxy.context.span_id, 16)}-"
    )
    decisions = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["request_id"], d["trace_id"]) for d in decisions] == [
        ("t1", TRACE), (untraced_id, root_trace),
    ]  # fmt: skip


def test_tracing_off_unless_asked() -> None:
    assert not Tracing.setup(False).enabled
    assert not wants_tracing(False, {"OTEL_SERVICE_NAME": "x"})
    assert wants_tracing(False, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not wants_tracing(False, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert wants_tracing(True, {})
    off = Tracing()
    ctx = RequestContext("r")
    with off.request_span(ctx, "x") as span, off.child_span(ctx, "y") as child:
        assert span is None and child is None
    assert off.traceparent(None) is None


def test_otel_flag_without_the_packages_is_a_clear_error() -> None:
    # A child process where importing opentelemetry fails, as where it is not installed.
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from router.front.tracing import Tracing, TracingError\n"
        "assert not Tracing.setup(True).enabled  # the environment alone: quietly off\n"
        "try:\n    Tracing.setup(True, required=True)\n"
        "except TracingError as exc:\n    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "--otel needs the OpenTelemetry packages: pip install 'kvroute[otel]'"
    )
    assert TracingError.__mro__[1].__name__ == "RouterError"
