"""The real SmolLM2-135M-Instruct (fp32) with shared, cached and swapped KV memory.

Greedy tokens are identical with prefix caching on and off, chunked prefill on and off, and
preemption by swap or recompute under a tiny KV budget (no request lost or left hanging); beam
search (width 4) equals HF transformers' beam search token for token; seeded n = 4 sampling is
reproducible and its samples share the prompt's blocks.
"""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.llm import LLM

# test_kv_memory_tiny.py runs the same KV paths quickly; beam search against HF is checked only here
pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant who answers briefly and precisely, in plain English, without lists. "
PROMPTS = [
    SYSTEM + "The capital of France is",
    "def fibonacci(n):",
    SYSTEM + "Once upon a time, in a small village,",
    "The three primary colors are",
    SYSTEM + "In 1969, the first humans to walk on the Moon were",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), dtype="float32", enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def cached_llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32")  # prefix caching is on by default


def test_prefix_caching_keeps_greedy_tokens(cached_llm, reference):
    for _ in range(2):  # the second round finds every prompt's full blocks cached
        outs = cached_llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
    usage, tokenize = cached_llm.engine.kv_usage(), cached_llm.engine.tokenize
    assert usage.prefix_hit_tokens >= sum((len(tokenize(p)[1]) - 1) // 16 * 16 for p in PROMPTS) > 0


KV_CONFIGS = {
    "chunked prefill, no prefix caching": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "chunked prefill, prefix caching": dict(max_num_batched_tokens=16),
    # 8 blocks of 16 tokens: two or three requests at a time, the later ones preempted
    "swap": dict(
        num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=64, preemption_mode="swap", swap_space_gib=0.01
    ),
    "recompute": dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("name", list(KV_CONFIGS), ids=list(KV_CONFIGS))
def test_greedy_tokens_do_not_depend_on_kv_management(smollm2_dir, reference, name):
    llm = LLM(model=str(smollm2_dir), dtype="float32", **KV_CONFIGS[name])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs), "a request was lost"
    stats, usage = llm.engine.stats(), llm.engine.kv_usage()
    assert not llm.engine.has_unfinished() and usage.num_used_blocks == 0 and usage.num_swapped_blocks == 0
    if name == "swap":  # (the fallback to recompute when the CPU pool is full: test_kv_memory_tiny)
        assert stats["preemptions_swap"] > 0, stats
    if name == "recompute":
        assert stats["preemptions"] > 0 == stats["preemptions_swap"]


# --------------------------------------------------------------------------- beam search


def _chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# each group: prompts of one token length, so HF runs them as one batch without padding
BEAM_GROUPS = {
    "chat, ends at EOS": ([_chat(f"What is the capital of {c}?") for c in ("France", "Spain", "Italy", "Japan")], 1.0),
    "text, max length": (
        ["The capital of France is", "The three primary colors are", "The best way to learn", "The meaning of life is"],
        2.0,
    ),
}


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    return AutoTokenizer.from_pretrained(smollm2_dir), LlamaForCausalLM.from_pretrained(
        smollm2_dir, torch_dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("group", list(BEAM_GROUPS), ids=list(BEAM_GROUPS))
def test_beam_search_matches_hf_transformers(hf, cached_llm, group):
    prompts, length_penalty = BEAM_GROUPS[group]
    tok, model = hf
    ids = torch.tensor([tok.encode(p) for p in prompts])
    eos = sorted(cached_llm.engine.parts.eos_token_ids)
    hf = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=4,
        num_return_sequences=2,
        do_sample=False,
        max_new_tokens=14,
        length_penalty=length_penalty,
        early_stopping=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    expected = []
    for row in hf[:, ids.shape[1] :].tolist():  # HF pads finished beams with the pad (= EOS) token
        cut = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
        expected.append(row[: cut + 1])
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=14, length_penalty=length_penalty)
    outs = cached_llm.generate(prompts, params)
    got = [c.token_ids for o in outs for c in o.outputs]
    assert got == expected
    if group.startswith("chat"):
        assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)


def test_seeded_parallel_sampling_is_reproducible_and_shares_blocks(cached_llm):
    params = SamplingParams(n=4, max_tokens=16, temperature=0.8, top_p=0.95, seed=1234)
    first = cached_llm.generate([PROMPTS[2]], params)[0]
    engine = cached_llm.engine
    rid = engine.add_request(PROMPTS[2], params)
    engine.add_request(PROMPTS[1], GREEDY)  # a different batch around it
    saved, results = 0, {}
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
        saved = max(saved, engine.kv_usage().num_saved_blocks)
    assert [c.token_ids for c in results[rid].outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "four samples, one answer"
    assert saved >= 3, "the samples share the prompt's blocks"
