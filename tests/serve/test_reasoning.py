"""`infer serve --reasoning-parser`: a chat's reasoning comes as `reasoning_content`, whole and streamed
(the streamed pieces join to the whole split), through the official openai client; the raw text is
the engine's own for the same request (`LLM.chat`, greedy), split by the same parser. The output is
held to think tags by a regex constraint, so a tiny random model writes reasoning deterministically."""

from __future__ import annotations

import openai
import pytest

from infer import LLM, SamplingParams
from infer.api.reasoning import split
from infer.plugins.reasoning_parser.think_tags import DeepSeekR1Reasoning, Qwen3Reasoning
from infer.serve.app import create_app

MODEL = "tiny"
REGEX = "<think>[a-z ]{3,12}</think>\n\n[a-z ]{3,12}"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def client(tiny, live):
    server = live(create_app({MODEL: tiny.engine}, reasoning_parser="qwen3"))
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def raw(tiny_chat_dir) -> str:
    with LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, structured={"regex": REGEX})
        return llm.chat(MESSAGES, params)[0].outputs[0].text


def ask(client, **options):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, extra_body={"guided_regex": REGEX}, **options
    )


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_reasoning_comes_apart_from_the_answer(client, raw):
    message = ask(client).choices[0].message
    reasoning, content = split(Qwen3Reasoning(), raw)
    assert reasoning and content and raw.startswith("<think>")
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.content == content


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_streamed_pieces_join_to_the_whole_split(client):
    whole = ask(client).choices[0].message
    reasoning, content, chunks = "", "", 0
    for chunk in ask(client, stream=True):
        for choice in chunk.choices:
            chunks += 1
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert chunks > 3
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_without_a_parser_the_reasoning_stays_in_the_content(tiny, live, raw):
    server = live(create_app({MODEL: tiny.engine}))
    plain = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    message = ask(plain).choices[0].message
    assert message.content == raw and message.model_extra.get("reasoning_content") is None


def test_an_unknown_parser_is_refused_naming_the_choices(tiny):
    with pytest.raises(Exception, match=r"unknown --reasoning-parser 'nope'.*qwen3"):
        create_app({MODEL: tiny.engine}, reasoning_parser="nope")


# the Responses API: a reasoning item before the message. Its text format is a JSON schema, so the output is
# held to a JSON string whose characters reason, then answer (deepseek-r1 reasons from the text's start)
QUOTED = {"type": "string", "pattern": "^[a-z]{3,10}</think>[a-z]{3,10}$"}
TEXT = {"format": {"type": "json_schema", "name": "thought", "schema": QUOTED}}


@pytest.fixture(scope="module")
def responses(tiny, live):
    server = live(create_app({MODEL: tiny.engine}, reasoning_parser="deepseek-r1"))
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def quoted(tiny_chat_dir) -> str:
    with LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=40, structured={"json": QUOTED})
        return llm.chat(MESSAGES, params)[0].outputs[0].text


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_responses_carry_a_reasoning_item_whole_and_streamed(responses, quoted):
    reasoning, content = split(DeepSeekR1Reasoning(), quoted)
    assert reasoning and content and "</think>" in quoted
    kwargs = dict(model=MODEL, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=40, text=TEXT)
    whole = responses.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning and whole.output_text == content
    events = list(responses.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning and [e for e in events if e.type == "response.reasoning_text.done"]
    final = next(e.response for e in events if e.type == "response.completed")
    assert final.output_text == content and final.output[0].content[0].text == reasoning
