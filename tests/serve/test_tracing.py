"""OpenTelemetry: a span per generation request, with the GenAI conventions' names and attributes, a child of
the caller's trace (traceparent), ended with an error status when the request fails; checked with the
SDK's in-memory exporter through the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from infer.serve.app import create_app
from infer.serve.tracing import otlp_tracer

MODEL = "tiny"


@pytest.fixture(scope="module")
def traced(tiny, live):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = live(create_app({MODEL: tiny.engine}, tracer=provider.get_tracer("test")))
    return server, exporter


def spans_after(exporter, call):
    exporter.clear()
    call()
    return exporter.get_finished_spans()


def test_a_request_is_one_span_with_its_usage(traced):
    server, exporter = traced
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    answer = {}

    def call():
        answer["chat"] = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, seed=3
        )

    (span,) = spans_after(exporter, call)
    chat = answer["chat"]
    assert span.name == f"chat {MODEL}" and span.kind is SpanKind.SERVER and span.status.status_code is StatusCode.UNSET
    a = span.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == ("chat", MODEL, 4)
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.request.seed"] == 3 and a["gen_ai.response.id"] == chat.id
    assert a["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    assert tuple(a["gen_ai.response.finish_reasons"]) == (chat.choices[0].finish_reason,)
    assert 0 < a["infer.time_to_first_token_s"] < 60


def test_a_streamed_request_ends_its_span_with_the_stream(traced):
    server, exporter = traced
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def call():
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True, n=2))

    (span,) = spans_after(exporter, call)
    assert span.name == f"text_completion {MODEL}" and span.attributes["gen_ai.usage.output_tokens"] == 6


def test_the_span_joins_the_caller_s_trace(traced):
    server, exporter = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}

    def call():
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/completions", json=body, headers=headers, timeout=60).status_code == 200

    (span,) = spans_after(exporter, call)
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent_id


def test_a_refused_request_ends_its_span_with_an_error(traced):
    server, exporter = traced

    def call():
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 10_000}
        assert httpx.post(f"{server.url}/completions", json=body, timeout=60).status_code == 400

    (span,) = spans_after(exporter, call)
    assert span.status.status_code is StatusCode.ERROR and "max_tokens" in span.status.description


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_an_otlp_tracer_is_built_for_an_endpoint():
    tracer = otlp_tracer("http://127.0.0.1:9/v1/traces")  # nothing listens: spans are dropped in the background
    assert tracer.start_span("x").get_span_context().is_valid
