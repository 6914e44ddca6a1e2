"""OpenTelemetry spans, one per HTTP generation request (`infer serve --otlp-traces-endpoint URL`).

Each completions or chat request gets a span named as OpenTelemetry's GenAI conventions name it
("chat MODEL", "text_completion MODEL"), a child of the caller's trace when the request carries a
`traceparent` header, with the request's settings, the response's id, the usage (input, output and
cached tokens), the finish reasons and the time to the first token; a request that fails ends its
span with an error status. Spans go out in batches over OTLP/HTTP (`pip install 'infer[otel]'`);
without an endpoint nothing is traced and nothing is imported.
"""

from __future__ import annotations

from typing import Any, Mapping

from infer.api.errors import ConfigError

EXTRA = "pip install 'infer[otel]'"


def otlp_tracer(endpoint: str) -> Any:
    """A tracer whose spans are exported in batches to the OTLP/HTTP collector at `endpoint`
    (e.g. http://127.0.0.1:4318/v1/traces)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): {EXTRA}") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "infer"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("infer.serve")


def start_span(tracer: Any, operation: str, model: str, headers: Mapping[str, str], settings: dict[str, Any]) -> Any:
    """The request's span, started now (a child of the caller's `traceparent`, if sent); None without a tracer."""
    if tracer is None:
        return None
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    attributes = {"gen_ai.operation.name": operation, "gen_ai.system": "infer", "gen_ai.request.model": model}
    attributes.update({f"gen_ai.request.{k}": v for k, v in settings.items() if v is not None})
    return tracer.start_span(
        f"{operation} {model}", context=extract(dict(headers)), kind=SpanKind.SERVER, attributes=attributes
    )


def end_span(span: Any, attributes: dict[str, Any], error: str | None) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
