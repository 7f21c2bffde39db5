"""OpenTelemetry spans per request: optional (the ``otel`` extra) and off by default.

The W3C trace context (``traceparent``/``tracestate``, in W3C's forms: another value is
dropped) travels in NATS headers whatever this says: from a client to its edge, and from the
edge to the worker with the queued request. With ``MESH_LOG_OTEL=true``, the edge records a
span ``mesh.edge.request`` under the client's context and the worker a span
``mesh.worker.request`` under the edge's, so one trace shows where the time went. Spans go to
whatever ``TracerProvider`` the process has; :func:`install_provider` sets one up exporting
over OTLP (``OTEL_EXPORTER_OTLP_ENDPOINT``...), the SDK's own settings.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from protocol.errors import ErrorCode, MeshError


class Tracing:
    """A node's spans; every method is a no-op when tracing is off."""

    def __init__(self, enabled: bool) -> None:
        self._tracer: Any = None
        if not enabled:
            return
        try:
            from opentelemetry import trace
        except ImportError:
            raise MeshError(
                "MESH_LOG_OTEL=true needs OpenTelemetry: pip install 'nats-llm-mesh[otel]'",
                code=ErrorCode.UNAVAILABLE,
                retryable=False,
            ) from None
        self._tracer = trace.get_tracer("nats-llm-mesh")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def span(
        self, name: str, headers: Mapping[str, str] | None, **attributes: Any
    ) -> contextlib.AbstractContextManager[Any]:
        """A span under the context in ``headers`` (W3C), current while the block runs; with
        tracing off, a context that gives None (no generator made per request)."""
        if self._tracer is None:
            return _NO_SPAN
        return self._span(name, headers, attributes)

    @contextlib.contextmanager
    def _span(
        self, name: str, headers: Mapping[str, str] | None, attributes: dict[str, Any]
    ) -> Iterator[Any]:
        assert self._tracer is not None
        from opentelemetry.propagate import extract

        parent = extract(dict(headers or {}))
        with self._tracer.start_as_current_span(
            name, context=parent, attributes={k: v for k, v in attributes.items() if v is not None}
        ) as span:
            yield span

    def inject(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        """``headers`` with the current span's context: what the next hop continues."""
        carrier = dict(headers or {})
        if self._tracer is not None:
            from opentelemetry.propagate import inject

            inject(carrier)
        return carrier


_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
"""What :meth:`Tracing.span` gives with tracing off (it holds nothing: one serves all)."""


def install_provider(service: str) -> None:
    """Export spans over OTLP/HTTP from this process (needs the ``otel`` extra)."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")
"""W3C's forms: a ``traceparent`` (version, trace id, parent id, flags) and a ``tracestate``
of printable ASCII, at most 512 characters."""


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The trace context among ``headers``, named in lower case and passed on only in W3C's
    forms: a client's header that is not one (bytes that are not UTF-8, 70 KB) is dropped, not
    carried into the queued request, where the server would refuse the whole request (or
    nats-py fail encoding it)."""
    found: dict[str, str] = {}
    for key, value in (headers or {}).items():
        name = key.lower()  # W3C's spelling, where readers look (NATS headers keep case)
        if name == "traceparent" and _TRACEPARENT.fullmatch(value.strip()):
            found[name] = value.strip()
        elif name == "tracestate" and _TRACESTATE.fullmatch(value):
            found[name] = value
    return found
