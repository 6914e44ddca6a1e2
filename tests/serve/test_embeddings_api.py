"""POST /v1/embeddings through the official `openai` client on a live server: the vectors equal `LLM.embed`'s
for the same inputs, as floats and as base64, beside streamed generation on the same engine; bad input is a
400 in OpenAI's error shape and takes nothing else down."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest

from infer.api.pooling import PoolingParams
from infer.serve.app import create_app

MODEL = "tiny"
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny):
    return [o.outputs.embedding for o in tiny.offline(lambda llm: llm.embed(TEXTS))]


def test_floats_equal_llm_embed(client, offline):
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == MODEL
    for data, want in zip(answer.data, offline):
        np.testing.assert_allclose(data.embedding, want, atol=1e-6)
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0


def test_base64_is_what_the_client_decodes(client, offline):
    """The client asks for base64 by default and decodes it with numpy: the same vectors come out."""
    answer = client.embeddings.create(model=MODEL, input=TEXTS[0])
    np.testing.assert_allclose(answer.data[0].embedding, offline[0], atol=1e-6)


def test_token_ids_in_equal_text_in(client, tiny, offline):
    ids = tiny.llm.tokenizer.encode(TEXTS[1])
    answer = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    np.testing.assert_allclose(answer.data[0].embedding, offline[1], atol=1e-6)


def test_embeddings_beside_a_stream(client, tiny):
    """A stream of generated tokens runs while embeddings are asked for: both complete, the stream's tokens
    those of the same request alone."""
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    alone = client.completions.create(**kwargs).choices[0].text
    got: list[str] = []

    def stream() -> None:
        got.extend(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(4):
        assert len(client.embeddings.create(model=MODEL, input=TEXTS).data) == 3
    thread.join(60)
    assert "".join(got) == alone


def test_dimensions_on_a_model_not_trained_for_them_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert "Matryoshka" in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, says",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "pooler": "mean"}, "pooler"),
        ({"input": [10**9]}, "49152"),
        ({"input": ["x"] * 2049}, "input"),
    ],
)
def test_bad_input_is_a_400_that_names_it(server, body, says):
    response = httpx.post(f"{server.url}/embeddings", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in f"{error.get('param')} {error['message']}" and error["type"] == "invalid_request_error"


def test_a_long_input_is_refused_with_its_limit(server, tiny):
    response = httpx.post(f"{server.url}/embeddings", json={"model": MODEL, "input": [7] * 5000}, timeout=30)
    assert response.status_code == 400 and "256" in response.json()["error"]["message"]
    assert tiny.idle() == (0, False)  # nothing was left queued or holding blocks


def test_offline_pooling_params_match_the_default(tiny):
    default, last = tiny.offline(lambda llm: llm.embed(TEXTS[0]) + llm.embed(TEXTS[0], PoolingParams("last")))
    assert default.outputs.embedding == last.outputs.embedding
