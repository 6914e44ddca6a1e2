"""The engine against HF transformers on a tiny random Llama: greedy tokens must be identical."""

import pytest
import torch

from infer import SamplingParams
from infer.llm import LLM

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3] * 17, [100, 7, 200, 13, 99, 42]]


def hf_greedy(folder, prompts, max_tokens):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, 12)


@pytest.mark.parametrize("scheduler", ["fcfs", "static"])
@pytest.mark.parametrize("sampler", ["vectorized", "naive"])
@pytest.mark.parametrize("num_kv_blocks", [None, 16])
def test_greedy_matches_hf(tiny_llama_dir, expected, scheduler, sampler, num_kv_blocks):
    llm = LLM(model=str(tiny_llama_dir), scheduler=scheduler, sampler=sampler, block_size=4, num_kv_blocks=num_kv_blocks)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    if num_kv_blocks and scheduler == "fcfs":
        assert llm.engine.stats()["preemptions"] > 0  # the tiny budget really forced preemption


def test_chunked_prefill_matches_hf(tiny_llama_dir, expected):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, max_num_batched_tokens=7)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_request_that_can_never_fit_ends_with_capacity(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=6)
    outs = llm.generate([list(range(10, 50)), [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert outs[0].outputs[0].finish_reason == "capacity"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
