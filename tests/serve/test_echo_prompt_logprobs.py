"""echo and prompt_logprobs over HTTP, through the official openai client: echo puts the prompt's text
before each choice's (streamed in its first chunk), and with logprobs its tokens' logprobs before the
output's (the first None: nothing comes before it); prompt_logprobs (vLLM's) gives each prompt token's
scored tokens. The figures equal the engine's own for the same request (`LLM`, same weights)."""

from __future__ import annotations

import httpx
import openai
import pytest

from infer import LLM, SamplingParams
from infer.serve.app import create_app

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_chat_dir):
    """The engine's own prompt logprobs and greedy output for PROMPT, on a second engine of the same weights."""
    with LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256) as llm:
        params = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2, logprobs=2)
        return llm.generate([PROMPT], params)[0]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_echo_puts_the_prompt_before_the_output(client, reference):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert plain.choices[0].text == reference.outputs[0].text
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ids = client.completions.create(
        model=MODEL, prompt=reference.prompt_token_ids, max_tokens=5, temperature=0, echo=True
    )
    assert ids.choices[0].text.endswith(plain.choices[0].text) and PROMPT in ids.choices[0].text


def test_echo_streams_the_prompt_in_each_choice_s_first_chunk(client):
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, n=2, stream=True)
    )
    texts: dict[int, str] = {}
    first: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            first.setdefault(choice.index, choice.text)
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert set(texts) == {0, 1}
    assert all(first[i].startswith(PROMPT) for i in texts)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert texts[0] == texts[1] == whole.choices[0].text


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_echo_with_logprobs_covers_the_prompt_tokens_then_the_output(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    num_prompt, num_out = len(reference.prompt_token_ids), len(reference.outputs[0].token_ids)
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + num_out
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [scored[t] for t, scored in zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:])]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(want, abs=1e-4)
    want_out = [d[t] for t, d in zip(reference.outputs[0].token_ids, reference.outputs[0].logprobs)]
    assert lp.token_logprobs[num_prompt:] == pytest.approx(want_out, abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[num_prompt] == len(PROMPT)  # the output's offsets index the echoed text
    assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_on_both_routes(client, server, reference):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    prompt_logprobs = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(reference.prompt_token_ids)
    for token, scored, want in zip(reference.prompt_token_ids[1:], prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert scored[str(token)]["logprob"] == pytest.approx(want[token], abs=1e-4)
        assert set(scored) == {str(t) for t in want}  # the prompt's own token and the top 2
    answer = httpx.post(
        f"{server.url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    chat = answer.json()["prompt_logprobs"]
    assert chat[0] is None and all(len(scored) in (1, 2) for scored in chat[1:])


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "echo": "yes"}, "echo"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(server, body, param):
    answer = httpx.post(f"{server.url}/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
