"""Every error the server answers has OpenAI's body and the right status: 400 bad input (validation
included), 401 without the API key, 404 an unknown model or route, 429 with Retry-After when the
waiting queue is full; none of them disturbs a request running beside it."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_checks import error_of

from infer import LLM, SamplingParams
from infer.serve.app import create_app

MODEL = "tiny"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}, api_key=KEY))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.root, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


BAD_BODIES = [
    ({"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),  # pydantic's range
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),  # SamplingParams' range
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, "max_tokens"),  # past the context
    ({"model": MODEL, "prompt": "x " * 400}, "prompt"),  # longer than the context
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**6]}, None),  # a token id past the vocabulary
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 99}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"five": 10}}, "logit_bias"),  # keys are token ids
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"model": MODEL, "prompt": "x", "structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "no_such_field": 1}, "no_such_field"),
    ({"model": MODEL, "prompt": "x", "priority": "high"}, "priority"),
    ({"model": MODEL, "prompt": "x", "priority": 1.5}, "priority"),
    ({"model": MODEL, "prompt": "x", "priority": 2**31}, "priority"),
    ({"prompt": "x"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_completions_are_400s_naming_the_parameter(http, body, param):
    response = http.post("/v1/completions", json=body)
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


BAD_CHATS = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages.0.role"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        "tools.0.function",
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chats_are_400s(http, body, param):
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert error["param"] == param


def test_a_body_that_is_not_json_is_a_400(http):
    response = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    error_of(response, 400)


def test_unknown_model_and_route_are_404s(http):
    error = error_of(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert error["param"] == "model" and MODEL in error["message"]
    error_of(http.get("/v1/no-such-route"), 404)


def test_the_api_key_is_required(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{server.url}/completions", json=body, headers=headers)
        assert error_of(response, 401)["type"] == "authentication_error"
    assert httpx.get(f"{server.root}/health").status_code == 200  # probes need no key
    with openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_full_waiting_queue_is_a_429_with_retry_after(tiny_chat_dir, live):
    from infer.serve.async_engine import AsyncEngine

    llm = LLM(model=str(tiny_chat_dir), attention="torch", num_kv_blocks=32, max_model_len=128)
    engine = AsyncEngine(llm.engine, max_waiting=0)  # nothing may wait: every request is turned away
    try:
        server = live(create_app({MODEL: engine}))
        response = httpx.post(f"{server.url}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert error_of(response, 429)["type"] == "rate_limit_exceeded"
        assert int(response.headers["Retry-After"]) >= 1
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    finally:
        engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_errors_leave_a_running_request_alone(tiny, http):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = tiny.offline(lambda llm: llm.generate(["Once upon a time"], params))[0].outputs[0].text
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as running:
        for bad, _ in BAD_BODIES[:6]:
            error_of(http.post("/v1/completions", json=bad), 400)
        text = "".join(
            httpx_text(line) for line in running.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        )
    assert text == expected


def httpx_text(line: str) -> str:
    import json

    return json.loads(line[len("data: ") :])["choices"][0]["text"]


def test_priority_is_taken_by_both_routes(http):
    for route, body in [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": -3}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "priority": 7},
        ),
    ]:
        answer = http.post(route, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
