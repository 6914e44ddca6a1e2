"""A `$ref` in a request's JSON schema that points outside it (a URL, a file, another document) is a 400
naming the field, never fetched and never a silently unconstrained answer; one into the schema itself
('#/$defs/...') is followed."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_checks import error_of

from infer.serve.app import create_app

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
OUTSIDE = ["http://example.com/schema.json", "file:///etc/passwd", "other.json#/defs/a", "/abs/path"]


def _schema(ref: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}


def _tool_choice(schema: dict) -> dict:
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}


FIELDS = {
    "response_format": lambda s: {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
    },
    "structured_outputs": lambda s: {"structured_outputs": {"json": s}},
    "guided_json": lambda s: {"guided_json": json.dumps(s)},  # as JSON text
    "tool_choice": _tool_choice,  # a forced call's parameters constrain the output
}


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}))


@pytest.mark.parametrize("ref", OUTSIDE)
@pytest.mark.parametrize("param", list(FIELDS))
def test_a_ref_outside_the_schema_is_a_400_naming_the_field(server, param, ref):
    response = httpx.post(f"{server.url}/chat/completions", json={**CHAT, **FIELDS[param](_schema(ref))}, timeout=60)
    error = error_of(response, 400)
    assert error["param"] == param and ref in error["message"] and "$defs" in error["message"]


def test_a_ref_into_the_schema_is_followed(server):
    schema = {**_schema("#/$defs/word"), "$defs": {"word": {"type": "string", "enum": ["yes", "no"]}}}
    body = {**CHAT, "max_tokens": 40, **FIELDS["structured_outputs"](schema)}
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()["choices"][0]
    if out["finish_reason"] == "stop":
        assert json.loads(out["message"]["content"])["a"] in ("yes", "no")
