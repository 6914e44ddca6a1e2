"""usage.prompt_tokens_details.cached_tokens: the prompt tokens a request found in the prefix cache (whole
blocks), through the openai client; the engine reports them per request (`RequestOutput.num_cached_tokens`)."""

from __future__ import annotations

import uuid

import openai
import pytest

from infer import LLM, SamplingParams
from infer.serve.app import create_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny, live):
    server = live(create_app({MODEL: tiny.engine}))
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def test_a_repeated_prompt_reports_its_cached_blocks(client):
    prompt = f"{uuid.uuid4().hex} " + "a long shared system prompt about many things " * 4
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks, the last one computed
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    again = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in again if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= 16


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_engine_counts_cached_tokens_per_request(tiny_chat_dir):
    with LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256) as llm:
        ids = list(range(100, 140))
        params = SamplingParams(max_tokens=2, temperature=0)
        (cold,) = llm.generate([ids], params)
        (warm,) = llm.generate([ids], params)
        (other,) = llm.generate([ids[:20] + [7] * 20], params)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 32  # two whole blocks of 16; the last token is always computed
    assert other.num_cached_tokens == 16  # the first block is shared
