"""Per-request limits (`ServeLimits`): a request past one is a 400 naming the field and the option that
raises it, before any work is done for it (before its prompt is tokenized); one at the limit passes;
the OpenAPI schema states the limits it can; a limit that is not positive is a ConfigError."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_checks import error_of

from infer.api.errors import ConfigError
from infer.serve.app import create_app
from infer.serve.errors import APIError
from infer.serve.limits import ServeLimits
from infer.serve.protocol import ChatRequest, CompletionRequest
from infer.serve.request_limits import check_request, json_depth

MODEL = "tiny"
SMALL = ServeLimits(
    max_stop=2, max_logit_bias=2, max_schema_bytes=300, max_schema_depth=5, max_choices=2, max_choices_length=10,
    max_regex_length=8, max_grammar_length=30,
)  # fmt: skip
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)}}  # ~500 bytes
DEEP = {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}}  # 4
DEEPER = {"type": "object", "properties": {"a": DEEP}}  # 6
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
PROMPT = {"prompt": "Hi"}

# (fields past SMALL, the field named, the option named)
OVER = [
    ({"stop": ["a", "b", "c"]}, "stop", "--max-stop"),
    ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "--max-logit-bias"),
    ({"guided_choice": ["a", "b", "c"]}, "guided_choice", "--max-choices"),
    ({"guided_choice": ["abcdef", "ghijkl"]}, "guided_choice", "--max-choices-length"),
    ({"guided_regex": "[a-z]+[0-9]+"}, "guided_regex", "--max-regex-length"),
    ({"guided_grammar": 'root ::= "a" | "b" | "c" | "d" | "e"'}, "guided_grammar", "--max-grammar-length"),
    ({"guided_json": WIDE}, "guided_json", "--max-schema-bytes"),
    ({"guided_json": json.dumps(WIDE)}, "guided_json", "--max-schema-bytes"),  # as JSON text
    ({"guided_json": DEEPER}, "guided_json", "--max-schema-depth"),
    ({"structured_outputs": {"regex": "[a-z]+[0-9]+"}}, "structured_outputs", "--max-regex-length"),
    ({"structured_outputs": {"choice": ["a", "b", "c"]}}, "structured_outputs", "--max-choices"),
    ({"structured_outputs": {"json": DEEPER}}, "structured_outputs", "--max-schema-depth"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": WIDE}}},
        "response_format",
        "--max-schema-bytes",
    ),
]
AT_THE_LIMIT = [
    {"stop": ["a", "b"]},
    {"stop": "one stop string"},
    {"logit_bias": {"1": 1, "2": 1}},
    {"guided_choice": ["abcde", "fghij"]},
    {"guided_regex": "[a-z]+.."},
    {"guided_json": DEEP},
    {"structured_outputs": {"json": json.dumps(DEEP)}},
]


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}, limits=SMALL))


@pytest.mark.parametrize("fields,param,option", OVER)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_past_a_limit_is_a_400_naming_the_field_and_the_option(server, route, fields, param, option):
    body = {"model": MODEL, **(PROMPT if route == "/v1/completions" else CHAT), **fields, "max_tokens": 2}
    error = error_of(httpx.post(server.root + route, json=body, timeout=30), 400)
    assert error["param"] == param and error["code"] == "limit_exceeded", error
    assert option in error["message"] and error["type"] == "invalid_request_error"


def test_a_tools_schema_past_the_limit_is_refused(server):
    tools = [{"type": "function", "function": {"name": "wide", "parameters": WIDE}}]
    body = {"model": MODEL, **CHAT, "tools": tools, "tool_choice": "none"}
    error = error_of(httpx.post(f"{server.url}/chat/completions", json=body, timeout=30), 400)
    assert error["param"] == "tools" and "--max-schema-bytes" in error["message"]


def test_limits_are_checked_before_the_prompt_is_tokenized(server):
    body = {"model": MODEL, "prompt": "word " * 2000, "stop": ["a", "b", "c"]}  # past the context too
    assert error_of(httpx.post(f"{server.url}/completions", json=body, timeout=30), 400)["param"] == "stop"


@pytest.mark.parametrize("fields", AT_THE_LIMIT)
def test_a_request_at_the_limits_passes(fields):
    check_request(CompletionRequest.model_validate({"model": MODEL, **PROMPT, **fields}), SMALL)
    check_request(ChatRequest.model_validate({"model": MODEL, **CHAT, **fields}), SMALL)


def test_the_defaults_take_what_clients_send():
    body = {"model": MODEL, **CHAT, "stop": [f"s{i}" for i in range(32)], "guided_choice": ["yes", "no"] * 512}
    check_request(ChatRequest.model_validate(body), ServeLimits())
    with pytest.raises(APIError):
        check_request(ChatRequest.model_validate({**body, "stop": [f"s{i}" for i in range(33)]}), ServeLimits())


def test_the_openapi_schema_states_the_limits():
    from unittest import mock

    schema = create_app({MODEL: mock.MagicMock()}, limits=SMALL).openapi()
    for name in ("CompletionRequest", "ChatRequest"):
        fields = schema["components"]["schemas"][name]["properties"]

        def branch(field: str, json_type: str) -> dict:
            return next(b for b in fields[field]["anyOf"] if b.get("type") == json_type)

        assert branch("stop", "array")["maxItems"] == 2
        assert branch("logit_bias", "object")["maxProperties"] == 2
        assert branch("guided_choice", "array")["maxItems"] == 2 and branch("guided_choice", "array")["minItems"] == 1
        assert branch("guided_regex", "string")["maxLength"] == 8
        assert branch("guided_grammar", "string")["maxLength"] == 30
        assert branch("guided_json", "string")["maxLength"] == 300
        outputs = branch("structured_outputs", "object")
        assert outputs["additionalProperties"] is False and len(outputs["oneOf"]) == 5
        assert outputs["properties"]["regex"]["anyOf"][0]["maxLength"] == 8


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_json_depth_counts_containers_without_recursion():
    assert json_depth(1) == 0 and json_depth({}) == 1 and json_depth({"a": [1, {"b": 2}]}) == 3
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth(deep) == 100_001


def test_a_limit_must_be_positive():
    with pytest.raises(ConfigError, match="--max-stop"):
        ServeLimits(max_stop=0)
    with pytest.raises(ConfigError, match="--body-timeout"):
        ServeLimits(body_timeout_s=0.0)
