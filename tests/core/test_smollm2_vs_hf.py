"""The real SmolLM2-135M-Instruct: greedy tokens identical to HF transformers `generate` (fp32)."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.llm import LLM
from infer.testing.prompts import SMOLLM2_PROMPTS

PROMPTS = SMOLLM2_PROMPTS
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_tokens(smollm2_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    outs = []
    for text in PROMPTS:
        ids = torch.tensor([tok.encode(text)])
        # an explicit mask: the prompt contains <|im_end|>, which HF would otherwise take for padding
        y = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(y[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["fcfs", "static"])
@pytest.mark.parametrize("sampler", ["vectorized", "naive"])
def test_greedy_identical_to_hf(smollm2_dir, hf_tokens, params, scheduler, sampler):
    llm = LLM(model=str(smollm2_dir), dtype="float32", scheduler=scheduler, sampler=sampler)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens


@pytest.mark.slow
def test_greedy_identical_to_hf_under_preemption(smollm2_dir, hf_tokens, params):
    # 8 blocks of 16 tokens: two or three requests at a time, so later arrivals are preempted.
    llm = LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert llm.engine.stats()["preemptions"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_text_and_stop_strings(smollm2_dir):
    llm = LLM(model="smollm2-135m", dtype="float32")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=24, temperature=0)
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # ended at <|im_end|>
    cut = llm.generate(["The capital of France is"], SamplingParams(max_tokens=24, temperature=0, stop=["Paris"]))[
        0
    ].outputs[0]
    assert "Paris" not in cut.text and cut.finish_reason == "stop"
    assert llm.tokenizer.decode(cut.token_ids).find("Paris") >= 0  # the completing token is kept
