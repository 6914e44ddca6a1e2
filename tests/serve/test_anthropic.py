"""Anthropic's Messages API (`POST /v1/messages`) through the official `anthropic` client against a live
server: a plain message (its text the engine's own for the same greedy chat), streamed (the events
join to the same message), a forced tool call (a tool_use block whose input validates), a tool result
sent back, and errors in Anthropic's shape on this route (OpenAI's elsewhere)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from infer import LLM, SamplingParams
from infer.serve.app import create_app

MODEL = "tiny"
KEY = "sk-ant-test"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # today's client sends no temperature: the older field, as an extra


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}, api_key=KEY))


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_chat_dir) -> str:
    with LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256) as llm:
        return llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_plain_message_is_the_engine_s_greedy_chat(client, reference):
    message = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=ASK)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == reference
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    assert message.usage.input_tokens > 5 and message.id.startswith("msg_")


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_streamed_message_joins_to_the_same_message(client, reference):
    with client.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == reference and final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_is_a_tool_use_block(client, stream):
    options = dict(
        model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    if stream:
        with client.messages.stream(**options) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**options)
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and message.stop_reason == "tool_use"
    assert isinstance(calls[0].input["city"], str) and calls[0].id


def test_a_tool_result_goes_back_to_the_model(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
    ]
    message = client.messages.create(
        model=MODEL,
        max_tokens=4,
        extra_body=GREEDY,
        messages=history,
        tools=[WEATHER],
        system="Be brief.",
        tool_choice={"type": "none"},
    )
    assert message.content[0].type == "text" and message.usage.output_tokens == 4


def test_errors_have_anthropic_s_shape_on_this_route(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=server.root, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK
        )
    assert auth.value.body["error"]["type"] == "authentication_error"
    openai_route = httpx.post(
        f"{server.url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, headers={"x-api-key": KEY}
    )
    assert openai_route.status_code == 400 and "param" in openai_route.json()["error"]  # OpenAI's shape there
