"""Structured output and tool calls over a live server, with SmolLM2's real weights and the official
`openai` client: forced tool calls (a named function, "required") and response_format JSON equal
LLM.chat / LLM.generate under the same constraint and validate against their schemas, streamed and
not; tool_choice "auto" reads hermes calls; bad input is a 400 that leaves the server serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_checks import error_of

from infer import SamplingParams
from infer.serve.app import create_app
from infer.serve.constrained import calls_schema
from infer.serve.output_protocol import Tool

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server(smol, live):
    return live(create_app({MODEL: smol.engine}, tool_call_parser="hermes"))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def _reference(smol, schema: dict, max_tokens: int = 48) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured={"json": schema})
    return smol.offline(lambda llm: llm.chat(ASK, params, tools=TOOLS))[0].outputs[0].text


def _streamed_calls(stream) -> tuple[str, list[dict], str | None, int]:
    """(content, [{id, name, arguments}], the last finish reason, argument pieces) joined from the chunks."""
    content, calls, reason, pieces = "", {}, None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
                pieces += 1
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason, pieces


def _chat(client, max_tokens: int = 48, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_named_tool_choice_calls_it_with_valid_arguments(smol, client):
    expected = _reference(smol, WEATHER)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, tools=TOOLS, tool_choice=choice).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    [call] = out.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments == expected
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, reason, pieces = _streamed_calls(_chat(client, tools=TOOLS, tool_choice=choice, stream=True))
    assert content == "" and reason == "tool_calls" and pieces > 1  # the arguments came as they were generated
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", expected)]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_required_tool_choice_makes_calls_that_validate(smol, client):
    expected = json.loads(_reference(smol, calls_schema([Tool(**t) for t in TOOLS])))
    out = _chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    calls = out.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (e["name"], e["parameters"]) for e in expected
    ]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    content, streamed, reason, _ = _streamed_calls(_chat(client, tools=TOOLS, tool_choice="required", stream=True))
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_auto_reads_hermes_calls_after_content(client):
    # the model is made to write a hermes call (SmolLM2 has no tool format of its own), after some text
    call = (
        r'Checking\. <tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
    )
    extra = {"structured_outputs": {"regex": call}}
    out = _chat(client, 96, tools=TOOLS, tool_choice="auto", extra_body=extra).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Checking."
    [made] = out.message.tool_calls
    assert made.function.name == "get_weather"
    jsonschema.validate(json.loads(made.function.arguments), WEATHER)
    content, calls, reason, _ = _streamed_calls(_chat(client, 96, tools=TOOLS, extra_body=extra, stream=True))
    assert (content, reason) == ("Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", made.function.arguments)]
    plain = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_response_format_json_schema_and_json_object(smol, client):
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    params = SamplingParams(max_tokens=48, temperature=0, structured={"json": PERSON})
    expected = smol.offline(lambda llm: llm.chat(ask, params))[0].outputs[0].text
    out = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=48, response_format=form)
    assert out.choices[0].message.content == expected
    jsonschema.validate(json.loads(expected), PERSON)
    chunks = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=48, response_format=form, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    city = [{"role": "user", "content": "Give me a JSON object with the key 'city' set to Paris."}]
    params_object = SamplingParams(max_tokens=32, temperature=0, structured={"json_object": True})
    any_object = smol.offline(lambda llm: llm.chat(city, params_object))[0].outputs[0].text
    anything = client.chat.completions.create(
        model=MODEL, messages=city, temperature=0, max_tokens=32, response_format={"type": "json_object"}
    )
    assert anything.choices[0].message.content == any_object and isinstance(json.loads(any_object), dict)
    prompt = "A person, as JSON:"
    text = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=48, temperature=0, extra_body={"response_format": form}
    )
    reference = smol.offline(lambda llm: llm.generate([prompt], params))[0].outputs[0].text
    assert text.choices[0].text == reference
    jsonschema.validate(json.loads(reference), PERSON)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_guided_fields_and_token_controls_equal_llm_generate(smol, client):
    prompt = "The best colour is"
    colours = ["red", "green", "blue"]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"guided_choice": colours}
    )
    assert out.choices[0].text in colours
    token = smol.llm.tokenizer.encode(" blue")[0]
    forced = SamplingParams(max_tokens=6, temperature=0, logit_bias={token: 100}, min_tokens=6)
    expected = smol.offline(lambda llm: llm.generate([prompt], forced))[0].outputs[0]
    assert expected.token_ids == [token] * 6  # the bias forces it
    body = {"logit_bias": {str(token): 100}, "min_tokens": 6}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=body)
    assert out.choices[0].text == expected.text
    capital = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=capital, max_tokens=6, temperature=0).choices[0].text
    assert "Paris" in plain
    banned = SamplingParams(max_tokens=6, temperature=0, bad_words=["Paris"])
    expected = smol.offline(lambda llm: llm.generate([capital], banned))[0].outputs[0].text
    out = client.completions.create(
        model=MODEL, prompt=capital, max_tokens=6, temperature=0, extra_body={"bad_words": ["Paris"]}
    )
    assert out.choices[0].text == expected and "Paris" not in expected


BAD = [  # (endpoint, body, the parameter at fault, words of the message)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "get_weather, get_time"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice"),
    ("completions", {"logit_bias": {"blue": 5}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"99999999": 5}}, "logit_bias", "vocabulary"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ("completions", {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs",
     "exactly one"),
]  # fmt: skip


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint,body,param,words", BAD)
def test_bad_constraints_are_400s_and_the_next_request_runs(server, endpoint, body, param, words, stream):
    if endpoint == "chat":
        path, base = "/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4}
    else:
        path, base = "/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        error = error_of(http.post(path, json={**base, **body, "stream": stream}), 400)
        assert error["param"] == param and words in error["message"], error
        assert http.post(path, json=base).status_code == 200


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_auto_without_a_parser_names_the_flag(smol, live):
    bare = live(create_app({MODEL: smol.engine}))
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    for choice in ({}, {"tool_choice": "auto"}):
        error = error_of(httpx.post(f"{bare.url}/chat/completions", json={**body, **choice}, timeout=60), 400)
        assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    ok = httpx.post(f"{bare.url}/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"] is None
