"""Each field is checked for its JSON type, strictly, as OpenAI checks it: a string or a boolean for an
integer, a boolean for a number, a string for a boolean are 400s naming the field; an integer passes
for a number and a whole number written 5.0 for an integer (JSON Schema's integers). /tokenize refuses
text that is not Unicode (a lone surrogate) with a 400 naming the field, as the generation routes do."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_checks import error_of

from infer.serve.app import create_app

MODEL = "tiny"
PROMPT = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}

WRONG_TYPES = [
    ("/v1/completions", {**PROMPT, "n": "5"}, "n"),
    ("/v1/completions", {**PROMPT, "n": True}, "n"),
    ("/v1/completions", {**PROMPT, "n": 1.5}, "n"),
    ("/v1/completions", {**PROMPT, "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "seed": "1"}, "seed"),
    ("/v1/completions", {**PROMPT, "temperature": True}, "temperature"),
    ("/v1/completions", {**PROMPT, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {**PROMPT, "stream": 1}, "stream"),
    ("/v1/completions", {**PROMPT, "logprobs": True}, "logprobs"),  # an integer on this route
    ("/v1/completions", {**PROMPT, "echo": "false"}, "echo"),
    ("/v1/completions", {**PROMPT, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {**PROMPT, "prompt": [1, True]}, "prompt"),
    ("/v1/completions", {**PROMPT, "user": 5}, "user"),
    ("/v1/completions", {**PROMPT, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ("/v1/completions", {**PROMPT, "logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens"),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "true"}},
        },
        "response_format",
    ),  # fmt: skip
    ("/detokenize", {"model": MODEL, "tokens": [1, "2"]}, "tokens"),
    ("/tokenize", {"model": MODEL, "prompt": "Hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/v1/completions", {**PROMPT, "seed": 2**53}, "seed"),  # past JSON's exact integers
    ("/v1/completions", {**PROMPT, "seed": -(2**63) - 192}, "seed"),  # what a fuzzer sent for -2**63
]


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}))


@pytest.mark.parametrize("route,body,param", WRONG_TYPES)
def test_a_value_of_the_wrong_json_type_is_a_400_naming_the_field(server, route, body, param):
    error = error_of(httpx.post(server.root + route, json=body, timeout=30), 400)
    assert error["param"] is not None and error["param"].split(".")[0] == param, error


RIGHT_TYPES = [
    ("/v1/completions", {**PROMPT, "temperature": 1, "top_p": 1, "presence_penalty": 0}),  # integers for numbers
    ("/v1/completions", {**PROMPT, "n": 2.0, "max_tokens": 1.0, "seed": 7.0}),  # whole numbers for integers
    ("/v1/completions", {**PROMPT, "seed": 2**53 - 1}),  # the largest seed
    ("/v1/completions", {**PROMPT, "seed": -(2**53 - 1)}),
    ("/v1/completions", {**PROMPT, "prompt": [1.0, 2, 3], "logprobs": 0, "logit_bias": {"5": 1}}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": False}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "max_tokens": 4}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2.0]}),
]


@pytest.mark.parametrize("route,body", RIGHT_TYPES)
def test_values_of_the_right_json_type_pass(server, route, body):
    response = httpx.post(server.root + route, json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_the_openai_client_passes(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, n=1, seed=3, logprobs=1)
        assert out.choices[0].logprobs is not None
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_completion_tokens=2,
            temperature=0.5,
            top_p=0.9,
            logprobs=True,
            top_logprobs=2,
            stream=False,
            stop=["\n"],
        )
        assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL, "prompt": "a \ud800 b"}, "prompt"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages"),
    ],
)
def test_tokenize_refuses_text_that_is_not_unicode(server, body, param):
    error = error_of(_escaped_post(f"{server.root}/tokenize", body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_generation_routes_refuse_it_as_tokenize_does(server):
    error = error_of(_escaped_post(f"{server.url}/completions", {**PROMPT, "prompt": "\ud800"}), 400)
    assert error["param"] == "prompt"  # validation's "not a valid string"


def _escaped_post(url: str, body: dict) -> httpx.Response:
    """The body with a lone surrogate written as JSON's escape ("\\ud800"), as such a client sends it."""
    content = json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=30)
