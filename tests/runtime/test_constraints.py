"""The token-level logits processors through LLM.generate: their writes to the step's logits (made in
inference mode by the forward) succeed, and the tokens are the ones they allow."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=128) as engine:
        yield engine


def test_logit_bias_and_allowed_token_ids_choose_the_tokens(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    free = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    forced = next(t for t in range(20, 40) if t not in free.token_ids)
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced: 100})
    assert llm.generate([prompt], biased)[0].outputs[0].token_ids == [forced] * 6
    allowed = [forced, forced + 1]
    only = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate([prompt], only)[0].outputs[0].token_ids) <= set(allowed)


def test_structured_output_nobody_serves_is_refused_not_ignored(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    asked = SamplingParams(max_tokens=4, structured={"regex": "a+", "backend": "outlines"})
    bad, good = llm.generate([prompt, prompt], [asked, SamplingParams(max_tokens=4, ignore_eos=True)])
    assert bad.error is not None and "backend 'outlines' is not available" in bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 4
