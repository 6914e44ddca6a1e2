"""`SamplingParams.prompt_logprobs` on a tiny random Llama (fp32, CPU), against HF transformers' own
model: every prompt token's logprob and the top-N others equal log_softmax(HF logits) to 1e-4, in one
chunk or many, with prefix caching (a cached prefix is computed again), preemption, parallel samples,
speculative decoding and tensor-parallel ranks; with an FP8 KV cache they equal the engine's own
next-token logprobs after each prefix (the cache is quantized, so HF's are off by more)."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.api import prompt_logprobs
from infer.api.errors import RequestError
from infer.llm import LLM

PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(9 + 7 * i)] for i in range(6)] + [[42]]
TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir) -> list[torch.Tensor]:
    """Per prompt: log_softmax of HF's logits, [P, V] float32 (row p: the distribution of token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]


def check_against(reference: list[torch.Tensor], outputs, atol: float) -> None:
    for prompt, ref, out in zip(PROMPTS, reference, outputs, strict=True):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for p, scores in enumerate(got[1:]):
            token, row = prompt[p + 1], ref[p]
            assert token in scores and len(scores) <= TOP + 1
            assert set(scores) - {token} <= set(row.topk(TOP).indices.tolist())  # the top-N, and only them
            ids = list(scores)
            torch.testing.assert_close(torch.tensor([scores[t] for t in ids]), row[ids], atol=atol, rtol=0)


CONFIGS = {
    "one chunk": dict(),
    "chunked prefill": dict(max_num_batched_tokens=7, enable_prefix_caching=False),
    "recompute, tiny KV": dict(num_kv_blocks=16, max_model_len=64),
    "swap, tiny KV": dict(num_kv_blocks=16, max_model_len=64, preemption_mode="swap"),
    "speculative ngram, chunked": dict(decoding="speculative", draft="ngram", max_num_batched_tokens=9),
    "naive sampler, static scheduler": dict(sampler="naive", scheduler="static"),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_prompt_logprobs_equal_hf(tiny_llama_dir, hf_logprobs, name):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, **CONFIGS[name])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    for _ in range(2):  # the second round finds the prompts cached, and computes them again
        check_against(hf_logprobs, llm.generate(PROMPTS, params), atol=1e-4)
    if name == "one chunk":
        assert llm.engine.kv_usage().prefix_hit_tokens == 0
    if "tiny KV" in name:
        assert llm.engine.stats()["preemptions"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_tensor_parallel_ranks(tiny_llama_dir, hf_logprobs):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)
    with LLM(model=str(tiny_llama_dir), block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        check_against(hf_logprobs, llm.generate(PROMPTS, params), atol=1e-4)


def test_rows_are_scored_a_slice_at_a_time(tiny_llama_dir, hf_logprobs, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 5)  # every prompt spans several slices
    llm = LLM(model=str(tiny_llama_dir), block_size=4)
    check_against(hf_logprobs, llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=TOP)), atol=1e-4)


def test_outputs_and_other_requests_are_unchanged(tiny_llama_dir, hf_logprobs):
    """A request asking for prompt logprobs generates the tokens it would without them, beside one
    that does not ask (whose output has none), and parallel samples share one prompt's scores."""
    llm = LLM(model=str(tiny_llama_dir), block_size=4, max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    asked = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    mixed = llm.generate(PROMPTS, [asked if i % 2 else greedy for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in mixed] == plain
    assert all((o.prompt_logprobs is None) == (i % 2 == 0) for i, o in enumerate(mixed))
    samples = SamplingParams(n=3, max_tokens=4, seed=1, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(PROMPTS, samples)
    assert all(len(o.outputs) == 3 for o in outputs)
    check_against(hf_logprobs, outputs, atol=1e-4)


def test_fp8_kv_cache_scores_what_the_engine_samples_from(tiny_llama_dir, hf_logprobs):
    """The torch backend writes K/V into the cache before it attends, so a prefill row reads the same
    e4m3 values as a decode would: each prompt token's score equals the engine's own logprob for it
    after the prompt up to it, generated alone."""
    llm = LLM(model=str(tiny_llama_dir), block_size=4, kv_cache_dtype="fp8", attention="torch")
    vocab = llm.engine.parts.vocab_size
    scored = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    prefixes = [prompt[: p + 1] for prompt in PROMPTS for p in range(len(prompt) - 1)]
    alone = llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0, logprobs=vocab))
    expected = [prompt[p + 1] for prompt in PROMPTS for p in range(len(prompt) - 1)]
    own = torch.tensor([o.outputs[0].logprobs[0][t] for o, t in zip(alone, expected)])
    got = torch.tensor([s[t] for o, prompt in zip(scored, PROMPTS) for s, t in zip(o.prompt_logprobs[1:], prompt[1:])])
    torch.testing.assert_close(got, own, atol=1e-4, rtol=0)
    hf = torch.cat([ref[torch.arange(len(p) - 1), p[1:]] for ref, p in zip(hf_logprobs, PROMPTS)])
    assert (got - hf).abs().max() > 1e-3  # e4m3 K/V: a run equal to fp32's would prove nothing


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_a_bad_prompt_logprobs_is_refused_naming_the_fix(value):
    with pytest.raises(RequestError, match=r"invalid prompt_logprobs=.*: use None or an integer >= 0"):
        SamplingParams(prompt_logprobs=value)


def test_more_than_the_vocabulary_is_refused_alone(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4)
    too_many = SamplingParams(max_tokens=2, prompt_logprobs=257)
    good, bad = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=2), too_many])
    assert good.error is None and len(good.outputs[0].token_ids) == 2
    assert bad.error == "invalid prompt_logprobs=257: the vocabulary has 256 tokens"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_parallel_samples_preempted_and_computed_again(tiny_llama_dir, hf_logprobs):
    """n samples share their first request's prompt; preempted and computed again, a sample's chunk runs past
    the prompt. They scored no prompt rows of their own, so such a chunk once indexed past the prompt and
    failed the step (IndexError; found by the server's fuzz with n=20): the output's scores are the first's."""
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=16)
    params = SamplingParams(n=6, max_tokens=24, temperature=1.0, seed=1, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.stats()["preemptions"] > 0, "nothing was preempted: the cache was roomy enough"
    check_against(hf_logprobs, outputs, atol=1e-4)
    for prompt, out in zip(PROMPTS, outputs):  # every sample ran to max_tokens or the context's end
        assert len(out.outputs) == 6 and all(len(c.token_ids) == min(24, 64 - len(prompt)) for c in out.outputs)
