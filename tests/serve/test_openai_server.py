"""A live server on loopback, driven by the official `openai` client: completions and chat completions,
plain and streamed, equal LLM.generate / LLM.chat token for token; seeded samples reproduce; logprobs
are the engine's; of 64 concurrent streams a third leave mid-way and the rest end complete."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from infer import SamplingParams
from infer.serve.app import create_app

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}], [{"role": "user", "content": "Say hi."}]]
AS_IDS = {"return_tokens_as_token_ids": True}  # logprobs name tokens "token_id:N": token-for-token comparison
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=0)


@pytest.fixture(scope="module")
def server(smol, live):
    return live(create_app({MODEL: smol.engine}))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_greedy_completions_equal_llm_generate(smol, client):
    expected = smol.offline(lambda llm: llm.generate(PROMPTS, GREEDY))
    for prompt, ref in zip(PROMPTS, expected):
        want = ref.outputs[0]
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert plain.choices[0].text == want.text and plain.choices[0].finish_reason == want.finish_reason
        assert plain.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert plain.usage.completion_tokens == len(want.token_ids)
        with_ids = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0, extra_body=AS_IDS
        )
        assert _ids(with_ids.choices[0].logprobs.tokens) == want.token_ids
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0, stream=True, extra_body=AS_IDS
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert (
            _ids([t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]) == want.token_ids
        )
        assert chunks[-1].choices[0].finish_reason == want.finish_reason


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_batch_of_prompts_answers_in_order(smol, client):
    expected = smol.offline(lambda llm: llm.generate(PROMPTS, GREEDY))
    ids = [r.prompt_token_ids for r in expected]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)  # token-id prompts
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in expected]
    assert out.usage.prompt_tokens == sum(map(len, ids))


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_greedy_chat_completions_equal_llm_chat(smol, client):
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0)
    expected = smol.offline(lambda llm: llm.chat(CHATS, params))
    for messages, ref in zip(CHATS, expected):
        want = ref.outputs[0]
        plain = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, extra_body=AS_IDS
        )
        choice = plain.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == want.text
        assert _ids([t.token for t in choice.logprobs.content]) == want.token_ids
        assert plain.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_two_seeded_samples_reproduce(smol, client):
    ask = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0.9, n=2, seed=1234)
    first = client.completions.create(**ask, logprobs=0, extra_body=AS_IDS)
    again = client.completions.create(**ask, logprobs=0, extra_body=AS_IDS)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    params = SamplingParams(max_tokens=12, temperature=0.9, n=2, seed=1234, logprobs=0)
    expected = smol.offline(lambda llm: llm.generate([PROMPTS[2]], params))[0]
    assert texts == [c.text for c in expected.outputs]
    tokens = [_ids(c.logprobs.tokens) for c in sorted(first.choices, key=lambda c: c.index)]
    assert tokens == [c.token_ids for c in expected.outputs]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_logprobs_are_the_engines(smol, client):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    ref = smol.offline(lambda llm: llm.generate([PROMPTS[0]], params))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-6)
    for top, d in zip(lp.top_logprobs, ref.logprobs):
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(d.values(), reverse=True)[:3], abs=1e-6)
    assert lp.tokens == [smol.llm.tokenizer.decode([t]) for t in ref.token_ids]
    chat_params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    chat_ref = smol.offline(lambda llm: llm.chat(CHATS[0], chat_params))[0].outputs[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    for entry, t, d in zip(chat.choices[0].logprobs.content, chat_ref.token_ids, chat_ref.logprobs):
        assert entry.logprob == pytest.approx(d[t], abs=1e-6) and len(entry.top_logprobs) == 2
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(sorted(d.values(), reverse=True)[:2], abs=1e-6)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_64_streams_of_which_a_third_leave(smol, server):
    prompts = [f"Write one sentence about the number {i}." for i in range(64)]
    leaving = set(random.Random(20).sample(range(64), 21))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in smol.offline(lambda llm: llm.generate(prompts, params))]

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        # a leaving client asks for 500 tokens: unless aborted, its request would run long after the others
        max_tokens = 500 if i in leaving else 16
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", "/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            text, chunks = "", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return text
                text += json.loads(line[len("data: ") :])["choices"][0]["text"]
                chunks += 1
                if i in leaving and chunks == 2:
                    return None  # leaving the block closes the connection mid-stream
        raise AssertionError(f"stream {i} ended without [DONE]")

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        assert (text is None) == (i in leaving)
        if text is not None:
            assert text == expected[i], f"stream {i}"
    deadline = time.monotonic() + 10
    while smol.idle() != (0, False):  # the aborts land within a step of each disconnect
        assert time.monotonic() < deadline, f"still held after the clients left: {smol.idle()}"
        time.sleep(0.05)
    assert smol.engine.num_waiting == 0
    metrics = httpx.get(f"{server.root}/metrics").text
    assert f'infer_requests_total{{model="{MODEL}",outcome="aborted"}} 21.0' in metrics
