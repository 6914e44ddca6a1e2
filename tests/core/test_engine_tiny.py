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
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_tokens,
        )
        outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, 12)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("scheduler", ["fcfs", "static"])
@pytest.mark.parametrize("sampler", ["vectorized", "naive"])
@pytest.mark.parametrize("num_kv_blocks", [None, 16])
def test_greedy_matches_hf(tiny_llama_dir, expected, scheduler, sampler, num_kv_blocks):
    llm = LLM(
        model=str(tiny_llama_dir),
        scheduler=scheduler,
        sampler=sampler,
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=num_kv_blocks and num_kv_blocks * 4,
    )  # a fixed cache must hold one request of max_model_len
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    if num_kv_blocks and scheduler == "fcfs":
        assert llm.engine.stats()["preemptions"] > 0  # the tiny budget really forced preemption


def test_chunked_prefill_matches_hf(tiny_llama_dir, expected):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, max_num_batched_tokens=7)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_request_longer_than_a_small_cache_is_rejected(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=6, max_model_len=24)
    outs = llm.generate([list(range(10, 50)), [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert "shorten the prompt" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4


def test_bad_request_in_batch_does_not_disturb_others(tiny_llama_dir, expected):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, max_model_len=64)
    prompts = [PROMPTS[0], [], list(range(3, 100)), [5000], PROMPTS[1]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert outs[0].error is None and outs[0].outputs[0].token_ids == expected[0]
    assert "empty prompt" in outs[1].error
    assert "shorten the prompt" in outs[2].error
    assert "token ids must be integers" in outs[3].error
    assert outs[4].error is None and outs[4].outputs[0].token_ids == expected[1]


def test_invalid_sampling_params_rejected_per_request(tiny_llama_dir, expected):
    llm = LLM(model=str(tiny_llama_dir), block_size=4)
    good = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    bad = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    bad.top_p = 1.5  # mutated after construction: still caught when the request is added
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [bad, good])
    assert "top_p" in outs[0].error
    assert outs[1].outputs[0].token_ids == expected[1]


def test_abort_frees_all_blocks(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.kv_usage().num_used_blocks > 0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_usage().num_used_blocks == 0


def test_two_engines_with_different_plugins_in_one_process(tiny_llama_dir, expected):
    a = LLM(model=str(tiny_llama_dir), block_size=4, scheduler="static", sampler="naive")
    b = LLM(model=str(tiny_llama_dir), block_size=8, scheduler="fcfs", sampler="vectorized")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in a.generate(PROMPTS, params)] == expected
    assert [o.outputs[0].token_ids for o in b.generate(PROMPTS, params)] == expected
