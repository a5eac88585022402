"""OpenTelemetry spans for the proxy's requests: optional (the ``otel`` extra), on with ``--otlp-traces-endpoint``.

One span per OpenAI request, a child of the client's ``traceparent`` when it sent one, with a child
span per stage of the proxy's timeline (``Exchange.stamps``): D's registration, P's prefill (the
layer-wise transfer runs inside it), D's first token (the transfer's end and D's first step), the
relay. P and D get the request span's ``traceparent``, so a vLLM started with its own
``--otlp-traces-endpoint`` puts its spans under the proxy's. The stage spans are written when the
request ends, from times taken on the way: nothing is exported on the request's path (the SDK's batch
processor exports from its own thread).
"""

from __future__ import annotations

import os
import time
from typing import Any

TRACE_HEADERS = ("traceparent", "tracestate")
# (span name, from stamp, to stamp): "" is the request's start; a stage whose end is missing is left out
STAGES = (("registration", "", "registered"),
          ("prefill", "registered", "p_answered"),
          ("first_token", "registered", "first_chunk"),
          ("first_token", "registered", "d_answered"),   # a whole answer: D's reply is its first token
          # late binding: no registration stage; P and D are sent the request together ("dispatched")
          ("prefill", "dispatched", "p_answered"),
          ("first_token", "dispatched", "first_chunk"),
          ("first_token", "dispatched", "d_answered"),
          ("relay", "first_chunk", "end"))
PROTOCOLS = ("grpc", "http/protobuf")


class TracingUnavailable(RuntimeError):
    """``--otlp-traces-endpoint`` was given but OpenTelemetry is not installed or not usable."""


def _exporter(endpoint: str, protocol: str) -> Any:
    """vLLM's choice of exporter: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, grpc unless told otherwise."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter(endpoint=endpoint)


class Tracing:
    """The proxy's tracer, or nothing (``enabled`` False) when no endpoint was given."""

    def __init__(self, endpoint: str = "", service_name: str = "aiolayer-proxy") -> None:
        self.enabled = bool(endpoint)
        self._provider: Any = None
        self._tracer: Any = None
        if not self.enabled:
            return
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        if protocol not in PROTOCOLS:
            raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: give one of {PROTOCOLS}")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            exporter = _exporter(endpoint, protocol)
        except ImportError as exc:
            raise TracingUnavailable(f"--otlp-traces-endpoint needs OpenTelemetry ({exc}): "
                                     "pip install 'aiolayer-vllm[otel]'") from None
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("aiolayer_vllm.proxy")

    def start(self, client_headers: dict[str, str], path: str, started: float) -> RequestSpan | None:
        """A request's span from ``started`` (``time.perf_counter()`` when the proxy took it, the origin of
        its stamps), child of the client's trace context if it sent one; None when tracing is off."""
        if not self.enabled:
            return None
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=client_headers)
        origin_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        span = self._tracer.start_span(f"POST {path}", context=parent, kind=SpanKind.SERVER, start_time=origin_ns,
                                       attributes={"http.request.method": "POST", "url.path": path})
        return RequestSpan(self._tracer, span, origin_ns)

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is buffered (bounded) and stop the exporter's thread."""
        if self._provider is not None:
            self._provider.force_flush(timeout_millis=int(timeout_s * 1e3))
            self._provider.shutdown()
            self._provider = None


class RequestSpan:
    """One request's span; ``finish`` adds the stage spans and ends it."""

    def __init__(self, tracer: Any, span: Any, origin_ns: int) -> None:
        self._tracer, self.span = tracer, span
        self._start_ns = origin_ns

    def trace_headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming this span: what P and D get instead of the client's."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier

    def finish(self, stamps: dict[str, float], attributes: dict[str, Any], error: str = "") -> None:
        """The stage spans from the request's timeline (ms since it was taken), then the request's end."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        end_ns = time.time_ns()
        times = {**stamps, "": 0.0, "end": (end_ns - self._start_ns) / 1e6}
        context = trace.set_span_in_context(self.span)
        for name, start, stop in STAGES:
            if start in times and stop in times and not (name == "first_token" and stop == "d_answered"
                                                         and "first_chunk" in times):
                child = self._tracer.start_span(name, context=context,
                                                start_time=self._start_ns + int(times[start] * 1e6))
                child.end(end_time=self._start_ns + int(times[stop] * 1e6))
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=end_ns)
