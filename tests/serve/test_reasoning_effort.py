"""reasoning_effort and chat_template_kwargs reach the chat template as its variables (a template that
reads them renders them into the prompt), chat_template_kwargs winning where both set one."""

from __future__ import annotations

import httpx
import pytest
from conftest import Served
from transformers import AutoTokenizer

from infer import LLM
from infer.serve.app import create_app

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "|effort={{ reasoning_effort | default('unset') }}|thinking={{ enable_thinking | default('unset') }}|"
)


@pytest.fixture(scope="module")
def server(tiny_chat_dir, live):
    served = Served(LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256, chat_template=TEMPLATE))
    yield live(create_app({"t": served.engine}))
    served.close()


@pytest.mark.parametrize(
    "fields,rendered",
    [
        ({}, "hi|effort=unset|thinking=unset|"),
        ({"reasoning_effort": "high"}, "hi|effort=high|thinking=unset|"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "hi|effort=unset|thinking=False|"),
        (
            {
                "reasoning_effort": "low",
                "chat_template_kwargs": {"reasoning_effort": "medium", "enable_thinking": True},
            },
            "hi|effort=medium|thinking=True|",
        ),
    ],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_template_sees_them(server, tiny_chat_dir, fields, rendered):
    # prompt_logprobs: 0 names each prompt token (after the first) by id: the prompt the template rendered
    body = {"model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.url}/chat/completions", json={**body, **fields}, timeout=60)
    assert answer.status_code == 200, answer.text
    prompt = [int(next(iter(scored))) for scored in answer.json()["prompt_logprobs"][1:]]
    want = AutoTokenizer.from_pretrained(tiny_chat_dir)(rendered, add_special_tokens=False).input_ids
    assert prompt == want[1:] and answer.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_an_unknown_effort_is_a_400_naming_it(server):
    body = {"model": "t", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}
    answer = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "reasoning_effort"
