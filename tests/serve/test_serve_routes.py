"""Two models in one server, routed by `model`; /v1/models, /health, /tokenize, /detokenize; /metrics
parses as Prometheus text and counts what was served."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer import LLM, SamplingParams
from infer.serve.app import create_app
from infer.serve.async_engine import AsyncEngine

SMOL, TINY = "smollm2-135m", "tiny-chat"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smol, tiny, live):
    return live(create_app({SMOL: smol.engine, TINY: tiny.engine}))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def _samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.root}/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_route_by_model_name(smol, tiny, client):
    assert sorted(m.id for m in client.models.list().data) == sorted([SMOL, TINY])
    params = SamplingParams(max_tokens=12, temperature=0)
    for name, served in ((SMOL, smol), (TINY, tiny)):
        expected = served.offline(lambda llm: llm.generate([PROMPT], params))[0].outputs[0].text
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert out.model == name and out.choices[0].text == expected
    smol_text = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    tiny_text = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert smol_text != tiny_text  # two different engines answered


def test_health_tokenize_and_detokenize(smol, server):
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    tokens = httpx.post(f"{server.root}/tokenize", json={"model": SMOL, "prompt": PROMPT}).json()
    assert tokens["tokens"] == smol.llm.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    back = httpx.post(f"{server.root}/detokenize", json={"model": SMOL, "tokens": tokens["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    chat = [{"role": "user", "content": "Hi"}]
    rendered = httpx.post(f"{server.root}/tokenize", json={"model": TINY, "messages": chat}).json()
    assert rendered["tokens"] == smol.llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    # two models: a request must say which
    assert httpx.post(f"{server.root}/tokenize", json={"prompt": PROMPT}).status_code == 400


def test_metrics_parse_and_count(server, client):
    before = _samples(server)
    for _ in range(3):
        client.completions.create(
            model=TINY, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY, prompt=PROMPT, max_tokens=10_000)
    after = _samples(server)
    tiny = (("model", TINY),)

    def grew(name: str, labels: tuple = tiny) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("infer_requests_total", (("model", TINY), ("outcome", "finished"))) == 3
    assert grew("infer_requests_total", (("model", TINY), ("outcome", "rejected"))) == 1
    assert grew("infer_time_to_first_token_seconds_count") == 3
    assert grew("infer_request_queue_time_seconds_count") == 3
    assert grew("infer_request_queue_time_seconds_sum") <= grew("infer_time_to_first_token_seconds_sum")
    assert grew("infer_e2e_request_latency_seconds_count") == 3
    assert grew("infer_time_per_output_token_seconds_count") == 3
    assert grew("infer_generation_tokens_total") == 15
    assert grew("infer_engine_steps_total") >= 5
    for gauge in ("infer_num_requests_running", "infer_num_requests_waiting", "infer_kv_cache_usage_ratio"):
        assert after[(gauge, tiny)] == 0
    assert after[("infer_kv_cache_blocks", tiny)] == 128
    for name in ("infer_prefix_cache_hit_rate", "infer_num_preemptions_total", "infer_spec_decode_acceptance_rate"):
        assert (name, tiny) in after and (name, (("model", SMOL),)) in after


def test_debug_logs_say_where_each_request_waited(client):
    import logging

    import structlog
    from structlog.testing import capture_logs

    before = structlog.get_config()
    try:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
        with capture_logs() as logs:
            stream = client.completions.create(
                model=TINY, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"ignore_eos": True, "priority": 3}
            )
            assert len([c for c in stream if c.choices and c.choices[0].text is not None]) >= 1
            client.completions.create(model=TINY, prompt=PROMPT, max_tokens=2, temperature=0)
    finally:
        structlog.configure(**before)
    done = [e for e in logs if e["event"] == "request finished"]
    assert len(done) == 2 and [e["priority"] for e in done] == [3, 0]
    streamed, plain = done
    for e in done:
        assert 0 <= e["engine_queue_ms"] <= e["engine_ttft_ms"] <= e["engine_latency_ms"] <= e["server_ms"]
    assert e["log_level"] == "debug" and streamed["request_id"].startswith("cmpl-")
    assert streamed["engine_ttft_ms"] <= streamed["server_first_output_ms"] <= streamed["server_ms"]
    assert plain["server_first_output_ms"] is None  # a JSON answer has no first output of its own


def test_a_model_without_a_tokenizer_streams_as_it_steps(tiny_llama_dir, live):
    # token ids in, token ids out: each step's chunk carries empty text, so a client can still time it (a
    # reader that falls behind gets several steps in one chunk, so the count is not one per token)
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=128)
    assert llm.tokenizer is None
    engine = AsyncEngine(llm.engine)
    try:
        server = live(create_app({"tokenless": engine}))
        body = {"model": "tokenless", "prompt": [5, 6, 7], "max_tokens": 32, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as response:
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        steps = [c for c in chunks if c["choices"]]
        assert len(steps) >= 2 and all(c["choices"][0]["text"] == "" for c in steps)  # not only the last
        assert steps[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 32
    finally:
        engine.close()


def test_a_delta_of_tokens_without_text_makes_a_chunk():
    from infer.core.stream import CompletionDelta
    from infer.serve.formats import CompletionFormat

    assert CompletionFormat().chunks(None, 0, CompletionDelta(0, "", [], None)) == []  # nothing new: no chunk
    chunks = CompletionFormat().chunks(_Gen(), 0, CompletionDelta(0, "", [17], None))
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == ""


class _Gen:  # what a chunk reads of its request
    id, created, include_usage = "cmpl-1", 0, False
    served = type("Served", (), {"name": "m"})
