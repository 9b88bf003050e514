"""Optional OpenTelemetry spans around a request's routing decision and its proxying.

With ``--otel`` (or any ``OTEL_EXPORTER_*`` environment variable set) and the ``otel``
extra installed (``pip install 'kvroute[otel]'``), each inference request gets a server
span ``kvroute.request`` whose parent is the client's ``traceparent``, with two children:
``kvroute.decide`` (the worker chosen, the tokens matched) and ``kvroute.proxy`` (the
worker that answered, its status, the attempts). The worker receives the proxy span as its
``traceparent``, so its own spans join the same trace.

Without the flag, or without the packages, :class:`Tracing` is off: every method returns
at once and nothing of OpenTelemetry is imported. Spans are exported by the global tracer
provider when one is configured (``opentelemetry-instrument``); else the router sets up the
SDK's with an OTLP exporter when one is installed (``opentelemetry-exporter-otlp``,
configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables), and says so when none is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Final

from router.errors import RouterError
from router.front.request_context import RequestContext

__all__ = ["INSTALL_HINT", "Tracing", "TracingError", "wants_tracing"]

logger = logging.getLogger(__name__)

INSTALL_HINT: Final = "pip install 'kvroute[otel]'"
_SCOPE: Final = "kvroute.router"
_NO_SPAN: Final = contextlib.nullcontext(None)


class TracingError(RouterError):
    """Tracing was asked for and cannot be set up."""


def wants_tracing(flag: bool, environ: Mapping[str, str]) -> bool:
    """Whether tracing is on: ``--otel``, or an ``OTEL_EXPORTER_*`` variable is set."""
    return flag or any(name.startswith("OTEL_EXPORTER_") and environ[name] for name in environ)


class Tracing:
    """Spans of one router replica, or nothing at all.

    Args:
        tracer: An OpenTelemetry ``Tracer``; ``None`` turns tracing off.
    """

    def __init__(self, tracer: Any = None) -> None:
        self._tracer = tracer
        if tracer is not None:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._trace: Any = trace
            self._propagator: Any = TraceContextTextMapPropagator()

    @classmethod
    def setup(cls, enabled: bool, *, required: bool = False) -> Tracing:
        """Tracing as configured.

        Args:
            enabled: Tracing was asked for (flag or environment).
            required: Asked for explicitly (``--otel``): missing packages are an error,
                not a quiet "off".

        Raises:
            TracingError: ``required`` and the OpenTelemetry API is not installed.
        """
        if not enabled:
            return cls()
        try:
            from opentelemetry import trace
        except ImportError as exc:
            if required:
                raise TracingError(
                    f"--otel needs the OpenTelemetry packages: {INSTALL_HINT}"
                ) from exc
            logger.info("OTEL_EXPORTER_* is set but OpenTelemetry is not installed: no spans")
            return cls()
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):  # nobody configured the SDK
            provider = _sdk_provider()
        return cls(provider.get_tracer(_SCOPE) if provider is not None else None)

    @classmethod
    def with_provider(cls, provider: Any) -> Tracing:
        """Tracing into a given ``TracerProvider`` (tests, embedding applications)."""
        return cls(provider.get_tracer(_SCOPE))

    @property
    def enabled(self) -> bool:
        """Whether spans are made."""
        return self._tracer is not None

    def request_span(
        self, ctx: RequestContext, name: str
    ) -> contextlib.AbstractContextManager[Any]:
        """The request's server span, child of the client's ``traceparent``; sets
        ``ctx.span`` and, without a client trace, ``ctx.trace_id``."""
        if self._tracer is None:
            return _NO_SPAN
        carrier = ctx.forwarded_headers() if ctx.traceparent is not None else {}
        parent = self._propagator.extract(carrier)
        return self._span(name, parent, self._trace.SpanKind.SERVER, ctx, owner=True)

    def child_span(
        self, ctx: RequestContext, name: str, attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """A span under the request's span (``kvroute.decide``, ``kvroute.proxy``)."""
        if self._tracer is None or ctx.span is None:
            return _NO_SPAN
        parent = self._trace.set_span_in_context(ctx.span)
        kind = (
            self._trace.SpanKind.CLIENT
            if name == "kvroute.proxy"
            else self._trace.SpanKind.INTERNAL
        )
        return self._span(name, parent, kind, ctx, attributes=attributes)

    @contextlib.contextmanager
    def _span(
        self,
        name: str,
        parent: Any,
        kind: Any,
        ctx: RequestContext,
        *,
        owner: bool = False,
        attributes: Mapping[str, Any] | None = None,
    ) -> Iterator[Any]:
        span = self._tracer.start_span(
            name, context=parent, kind=kind, attributes={"kvroute.request_id": ctx.request_id}
        )
        if attributes:
            span.set_attributes(dict(attributes))
        if owner:
            ctx.span = span
            if ctx.trace_id is None:
                ctx.trace_id = format(span.get_span_context().trace_id, "032x")
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()
            if owner:
                ctx.span = None

    def traceparent(self, span: Any) -> str | None:
        """The ``traceparent`` that makes ``span`` a worker's parent (``None``: no span)."""
        if span is None:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    @staticmethod
    def annotate(span: Any, attributes: Mapping[str, Any]) -> None:
        """Add attributes to ``span`` (nothing without one)."""
        if span is not None:
            span.set_attributes(dict(attributes))


def _sdk_provider() -> Any:
    """The SDK's tracer provider with an OTLP exporter, set as the global one; ``None``
    when the SDK is not installed."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning(
            "tracing is on but opentelemetry-sdk is not installed (%s): spans are "
            "neither made nor exported",
            INSTALL_HINT,
        )
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "kvroute-router"}))
    exporter = _otlp_exporter()
    if exporter is None:
        logger.warning(
            "tracing is on but no OTLP exporter is installed (pip install "
            "opentelemetry-exporter-otlp): spans are made and their trace ids forwarded to "
            "workers, but exported nowhere"
        )
    else:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def _otlp_exporter() -> Any:
    """An OTLP span exporter (HTTP, else gRPC) configured from the environment, if any."""
    with contextlib.suppress(ImportError):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    with contextlib.suppress(ImportError):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    return None
