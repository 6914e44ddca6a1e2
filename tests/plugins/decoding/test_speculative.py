"""Speculative decoding is lossless: greedy tokens identical to `autoregressive` with every proposer,
at batch 1 and 8, under chunked prefill and under preemption; sampled runs are seeded and reproducible.
On the tiny random Llama and on the real SmolLM2-135M (fp32)."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.api.errors import ConfigError, IncompatiblePluginsError
from infer.llm import LLM
from infer.runtime.kv_cache import bytes_per_block
from infer.testing.prompts import SMOLLM2_PROMPTS

TINY_PROMPTS = [
    [5, 6, 7, 8, 9],
    [10, 11],
    list(range(20, 60)),
    [3] * 17,
    [100, 7, 200, 13, 99, 42],
    [7, 8, 7, 8, 7, 8],
    list(range(100, 130)),
    [1, 2, 3],
]
SMOL_PROMPTS = SMOLLM2_PROMPTS
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def random_llama(folder, seed: int, **shape):
    """A random HF Llama folder (config.json + safetensors, no tokenizer): a draft with a given vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(LlamaConfig(**{**config, **shape}, torch_dtype="float32"))
    model.save_pretrained(folder)
    return folder


def token_ids(outs) -> list[list[int]]:
    assert all(o.error is None and o.finished for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def run(llm: LLM, prompts, params=GREEDY, one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:  # batch 1: each request runs alone
        return [token_ids(llm.generate([p], params))[0] for p in prompts]
    return token_ids(llm.generate(prompts, params))


# --------------------------------------------------------------------------- tiny random Llama


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("tiny-draft"), seed=1, vocab_size=256)


@pytest.fixture(scope="module")
def tiny_expected(tiny_llama_dir):
    return run(LLM(model=str(tiny_llama_dir), block_size=4), TINY_PROMPTS)


def draft_options(name, model_dir, draft_dir) -> dict:
    """Engine options for a proposer named in a test id: same-model, dummy-draft, ngram or self-L."""
    if name.startswith("self-"):
        return dict(draft="self", exit_layer=int(name.removeprefix("self-")))
    return {
        "same-model": dict(draft=str(model_dir)),
        "dummy-draft": dict(draft=str(draft_dir)),
        "ngram": dict(draft="ngram"),
    }[name]


PROPOSERS = ["same-model", "dummy-draft", "ngram", "self-1", "self-2"]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("mode", ["batch-8", "batch-1", "preemption"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_tiny_greedy_identical_to_autoregressive(tiny_llama_dir, tiny_draft_dir, tiny_expected, proposer, mode):
    options = dict(block_size=4, decoding="speculative", **draft_options(proposer, tiny_llama_dir, tiny_draft_dir))
    if mode == "preemption":
        options.update(
            num_kv_blocks=16, max_model_len=60
        )  # 64 token slots for 8 requests of up to 40 + 16 + 4 lookahead
    llm = LLM(model=str(tiny_llama_dir), **options)
    assert run(llm, TINY_PROMPTS, one_at_a_time=mode == "batch-1") == tiny_expected  # no request lost either
    stats = llm.engine.stats()
    assert stats["spec_proposed"] > 0 or proposer == "ngram"
    if mode == "preemption":
        assert stats["preemptions"] > 0
    assert llm.engine.kv_usage().num_used_blocks == 0 or llm.config.enable_prefix_caching


@pytest.mark.parametrize(
    "extra",
    [
        dict(num_kv_blocks=20, max_model_len=76, max_num_batched_tokens=7),
        dict(num_speculative_tokens=7, scheduler="static"),
    ],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("proposer", ["same-model", "self-all"])
def test_a_draft_equal_to_the_target_is_always_accepted(tiny_llama_dir, tiny_expected, proposer, extra):
    # the draft's KV bookkeeping (catch-up over prefill chunks, rollback, preemption) is exact
    draft = dict(draft=str(tiny_llama_dir)) if proposer == "same-model" else dict(draft="self", exit_layer=3)
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="speculative", **draft, **extra)
    assert run(llm, TINY_PROMPTS) == tiny_expected
    stats = llm.engine.stats()
    assert stats["acceptance_rate"] > 0.97
    assert stats["mean_tokens_per_step"] > 0.97 * (llm.config.num_speculative_tokens + 1)
    assert stats["spec_draft_s"] > 0 and stats["spec_verify_s"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_sampled_speculation_is_seeded_and_independent_of_the_batch(tiny_llama_dir, tiny_draft_dir):
    params = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        ignore_eos=True,
        seed=11,
        repetition_penalty=1.1,
        presence_penalty=0.3,
    )
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="speculative", draft=str(tiny_draft_dir))
    batched = run(llm, TINY_PROMPTS, params)
    assert run(llm, TINY_PROMPTS, params) == batched
    assert run(llm, TINY_PROMPTS[2:4], params, one_at_a_time=True) == batched[2:4]
    assert all(len(t) == 12 for t in batched)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("proposer", ["ngram", "same-model"])
def test_greedy_with_penalties_identical_to_autoregressive(tiny_llama_dir, proposer):
    # greedy rows are accepted from the sampler's tokens (no distribution built): each row's penalties
    # count the draft tokens before it, as autoregressive decoding would have counted them
    params = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4
    )
    expected = run(LLM(model=str(tiny_llama_dir), block_size=4), TINY_PROMPTS, params)
    llm = LLM(
        model=str(tiny_llama_dir), block_size=4, decoding="speculative", **draft_options(proposer, tiny_llama_dir, None)
    )
    assert run(llm, TINY_PROMPTS, params) == expected
    stats = llm.engine.stats()
    assert stats["spec_accepted"] > 0 or proposer == "ngram"


def test_greedy_and_sampled_requests_share_an_ngram_step(tiny_llama_dir):
    # a batch that samples verifies on the device; its greedy rows still give autoregressive's tokens
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    expected = run(LLM(model=str(tiny_llama_dir), block_size=4), TINY_PROMPTS[0::2])
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="speculative", draft="ngram")
    params = [GREEDY, sampled] * 4
    first = token_ids(llm.generate(TINY_PROMPTS, params))
    assert first[0::2] == expected
    assert token_ids(llm.generate(TINY_PROMPTS, params)) == first  # seeded
    assert llm.engine.stats()["spec_proposed"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("as_rows", [True, False], ids=["decode-rows", "extend"])
@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["batch-1", "batch-8"])
def test_ngram_steps_without_a_draft_are_pipelined_and_lossless(tiny_llama_dir, tiny_expected, one_at_a_time, as_rows):
    # a step where prompt lookup finds nothing is a plain step: with decode pipelining the next one is
    # queued ahead; the next step takes it when it drafts nothing either, and when it drafts, its
    # verify takes each new token's row from it and computes only the drafts' rows (as decode rows, or
    # as one extend sequence per request where the backend does not write a step's K/V first)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    outputs = {}
    for pipelined in (False, True):
        options = dict(block_size=4, decoding="speculative", draft="ngram", pipeline_decode=pipelined)
        with LLM(model=str(tiny_llama_dir), **options) as llm:
            decoder = llm.engine.decoder
            decoder.as_rows = as_rows
            take, reused = decoder._take_ahead, []

            def counted(scheduled, take=take, reused=reused):
                ahead = take(scheduled)
                reused.append(ahead is not None)
                return ahead

            decoder._take_ahead = counted
            greedy = run(llm, TINY_PROMPTS, one_at_a_time=one_at_a_time)
            outputs[pipelined] = greedy, run(llm, TINY_PROMPTS, sampled, one_at_a_time=one_at_a_time)
            stats = llm.engine.stats()
        assert greedy == tiny_expected
        assert stats["spec_accepted"] > 0
        assert (stats.get("pipelined_steps", 0) > 0) == pipelined
        assert any(reused) == pipelined  # verify steps that reused a row computed ahead
    assert outputs[True] == outputs[False]  # the seeded samples too


def test_logprobs_of_accepted_tokens_match_autoregressive(tiny_llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, frequency_penalty=0.5)
    expected = LLM(model=str(tiny_llama_dir), block_size=4).generate(TINY_PROMPTS, params)
    got = LLM(model=str(tiny_llama_dir), block_size=4, decoding="speculative", draft=str(tiny_llama_dir)).generate(
        TINY_PROMPTS, params
    )
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == 10
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in lb)


def test_beams_advance_one_token_at_a_time_beside_speculating_requests(tiny_llama_dir):
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=8, temperature=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLM(model=str(tiny_llama_dir), block_size=4).generate(TINY_PROMPTS[:3], beams)
    llm = LLM(model=str(tiny_llama_dir), block_size=4, decoding="speculative", draft=str(tiny_llama_dir))
    got = llm.generate(TINY_PROMPTS[:4], [beams] * 3 + [plain])
    assert [[c.token_ids for c in o.outputs] for o in got[:3]] == [[c.token_ids for c in o.outputs] for o in expected]
    assert llm.engine.stats()["spec_proposed"] > 0  # the plain request still speculated


def test_kv_budget_counts_both_models_and_the_draft_shares_block_ids(tiny_llama_dir, tiny_draft_dir):
    block_size, blocks = 4, 50
    per_block = bytes_per_block(3, block_size, 2, 16, torch.float32) + bytes_per_block(
        1, block_size, 1, 16, torch.float32
    )
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=block_size,
        decoding="speculative",
        draft=str(tiny_draft_dir),
        kv_cache_memory_gib=blocks * per_block / 2**30,
        max_model_len=blocks * block_size - 4,
    )  # 4 lookahead slots
    assert llm.engine.parts.describe["kv_blocks"] == blocks
    draft = llm.engine.decoder.proposer.runner
    assert len(draft.kv_caches) == 1 and draft.kv_caches[0][0].shape[:3] == (
        blocks + 1,
        block_size,
        1,
    )  # + the null block
    assert llm.engine.parts.describe["draft"] == str(tiny_draft_dir)


def test_speculative_refuses_bad_drafts(tiny_llama_dir, tmp_path):
    with pytest.raises(IncompatiblePluginsError, match="--draft"):
        LLM(model=str(tiny_llama_dir), decoding="speculative")
    with pytest.raises(ConfigError, match="--exit-layer"):
        LLM(model=str(tiny_llama_dir), decoding="speculative", draft="self")
    wrong_vocab = random_llama(tmp_path / "v512", seed=2, vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(model=str(tiny_llama_dir), decoding="speculative", draft=str(wrong_vocab))


# --------------------------------------------------------------------------- real SmolLM2-135M

SMOL_GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_expected(smollm2_dir):
    return run(LLM(model=str(smollm2_dir), dtype="float32"), SMOL_PROMPTS, SMOL_GREEDY)


@pytest.fixture(scope="module")
def smol_draft_dir(tmp_path_factory):
    # dummy weights, SmolLM2's vocabulary and context
    return random_llama(
        tmp_path_factory.mktemp("smol-draft"),
        seed=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["same-model", "dummy-draft", "ngram", "self-4", "self-12"])
def test_smollm2_greedy_identical_to_autoregressive(smollm2_dir, smol_draft_dir, smol_expected, proposer):
    draft = draft_options(proposer, smollm2_dir, smol_draft_dir)
    k = 4 if proposer == "same-model" else 2  # verifying k + 1 tokens per row costs about k + 1 decode steps on a CPU
    llm = LLM(model=str(smollm2_dir), dtype="float32", decoding="speculative", num_speculative_tokens=k, **draft)
    assert run(llm, SMOL_PROMPTS, SMOL_GREEDY) == smol_expected  # batch 8
    if proposer == "same-model":  # real weights, other batch shapes: still (nearly) every draft token accepted
        assert llm.engine.stats()["acceptance_rate"] > 0.95
    else:  # batch 1
        assert run(llm, SMOL_PROMPTS[5:6], SMOL_GREEDY, one_at_a_time=True) == smol_expected[5:6]


@pytest.mark.slow
def test_smollm2_greedy_identical_under_preemption(smollm2_dir, smol_expected):
    # 8 blocks of 8 tokens: a few requests at a time, and running ones outgrow them, so later arrivals are preempted
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        decoding="speculative",
        draft="self",
        exit_layer=4,
        num_speculative_tokens=2,
        block_size=8,
        num_kv_blocks=8,
        max_model_len=62,
        max_num_batched_tokens=48,
    )
    assert run(llm, SMOL_PROMPTS, SMOL_GREEDY) == smol_expected
    assert llm.engine.stats()["preemptions"] > 0


@pytest.mark.slow
def test_smollm2_ngram_accepts_tokens_on_a_repetitive_prompt(smollm2_dir):
    text = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps under the old oak tree."
    llm = LLM(model=str(smollm2_dir), dtype="float32", decoding="speculative", draft="ngram")
    out = llm.chat(
        [{"role": "user", "content": f"Repeat exactly: {text}"}], SamplingParams(max_tokens=32, temperature=0)
    )
    assert "lazy dog" in out[0].outputs[0].text
    stats = llm.engine.stats()
    assert stats["mean_accepted_tokens"] > 0.5 and stats["acceptance_rate"] > 0.2
