"""Steps with prompt tokens on the CUDA-graph path (`cuda_graph_max_tokens`), checked on the CPU with
stand-in graphs (`infer.testing.graphs`): each token a row of the captured forward. Greedy tokens and
their logprobs are the eager forward's, with chunked prefill, prefix caching, prompt logprobs and
preemption; a step past the limit, or asking more logits rows than a graph holds, runs eagerly."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.llm import LLM
from infer.testing.decoder import write_tiny_llamas
from infer.testing.graphs import attach_stand_in_graphs

PROMPTS = [list(range(20, 60)), [10, 11], [3] * 17, list(range(100, 190)), [5, 6, 7, 8, 9, 5, 6, 7]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
MAX_TOKENS = 64  # the 90-token prompt alone is past it


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_llamas(tmp_path_factory.mktemp("prefill-graphs"))[0]


def run(target, graphs: bool, prompts=PROMPTS, params=PARAMS, **options):
    """Outputs, and each forward's (tokens, replayed) when `graphs`."""
    with LLM(model=str(target), **{"block_size": 4, "max_num_seqs": 4, **options}) as llm:
        steps: list[tuple[int, bool]] = []
        if graphs:
            runner = llm.engine.parts.runners[0]
            attach_stand_in_graphs(runner, llm.engine.parts.max_model_len, MAX_TOKENS)
            eager_run = runner.run

            def recorded(step):
                steps.append((len(step.input_ids), step.use_graphs))
                return eager_run(step)

            runner.run = recorded
        outs = llm.generate(prompts, params)
        return outs, steps, llm.engine.stats()


def tokens_and_logprobs(outs):
    out = [o.outputs[0] for o in outs]
    return [c.token_ids for c in out], [[d[t] for d, t in zip(c.logprobs, c.token_ids)] for c in out]


SETTINGS = {
    "one-at-a-time": dict(max_num_seqs=1),
    "batched": dict(max_num_seqs=3),  # max_rows 3: a bucket of its own below the power of two
    "chunked": dict(max_num_batched_tokens=24),
    "preemption": dict(num_kv_blocks=40, max_model_len=120),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_steps_replay_as_rows_with_the_eager_tokens_and_logprobs(target, setting):
    options = SETTINGS[setting]
    expected, _, _ = run(target, False, **options)
    got, steps, stats = run(target, True, **options)
    ids, lps = tokens_and_logprobs(got)
    ref_ids, ref_lps = tokens_and_logprobs(expected)
    assert ids == ref_ids
    torch.testing.assert_close(lps, ref_lps, rtol=1e-4, atol=1e-4)
    prompt_steps = [(n, replayed) for n, replayed in steps if n > 4]  # more tokens than any decode step
    assert any(replayed for _, replayed in prompt_steps)
    assert all(replayed == (n <= MAX_TOKENS) for n, replayed in prompt_steps)
    if setting == "chunked":  # every chunk of the 90-token prompt replays, from the cache its chunks before wrote
        assert max(n for n, _ in steps) <= 24 and len(prompt_steps) >= 6
    else:
        assert any(not replayed for _, replayed in prompt_steps)  # the 90-token prompt, eagerly
    if setting == "preemption":
        assert stats["preemptions"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_speculative_decoding_with_prompt_steps_replayed_stays_lossless(target, max_num_seqs):
    """Prompt lookup (K = 4) verifies as decode rows in the buckets up to max_rows (5 or 15 rows, each
    with logits) while prompts and a prompt with its first draft replay as rows past them."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [*PROMPTS, [7, 8, 9] * 12]
    expected, _, _ = run(target, False, prompts, params, max_num_seqs=max_num_seqs)
    options = dict(max_num_seqs=max_num_seqs, decoding="speculative", draft="ngram", num_speculative_tokens=4)
    got, steps, stats = run(target, True, prompts, params, **options)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert stats["spec_accepted"] > 0
    assert any(replayed and n > 5 * max_num_seqs for n, replayed in steps)


def test_prompt_logprobs_replay_while_their_rows_fit_a_graph(target):
    """A step's logits rows (the prompt's and the sampled one) must fit the graph's max_rows (4
    here): the 3-token prompt replays, the 17-token one runs eagerly; both score as eagerly."""
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    for prompt, replayed in (([10, 11, 12], True), ([3] * 17, False)):
        expected, _, _ = run(target, False, [prompt], params)
        got, steps, _ = run(target, True, [prompt], params)
        assert steps[0] == (len(prompt), replayed)
        (o,), (e,) = got, expected
        assert o.outputs[0].token_ids == e.outputs[0].token_ids
        scores = [d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
        ref = [d[t] for d, t in zip(e.prompt_logprobs[1:], e.prompt_token_ids[1:])]
        torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-4)


def test_a_bucket_past_max_rows_computes_only_the_rows_asked(target):
    """Eleven rows of two sequences in the bucket of 16 (max_rows 4): the graph's logits are the two
    rows the step samples, the eager forward's; padded rows write only the null block."""
    with LLM(model=str(target), block_size=4, max_num_seqs=4) as llm:
        runner = llm.engine.parts.runners[0]
        graphs = attach_stand_in_graphs(runner, llm.engine.parts.max_model_len, MAX_TOKENS)
        null_block = graphs.null_block
        tokens, query_lens, seq_lens, tables = list(range(30, 41)), [7, 4], [7, 4], [[0, 1], [2]]
        before = [k.clone() for k, _ in runner.kv_caches]
        logits = graphs.run(tokens, seq_lens, tables, query_lens=query_lens, logits_rows=[6, 10]).clone()
        assert graphs.replays == {16: 1} and logits.shape[0] == 2
        changed = {int(b) for (k, _), k0 in zip(runner.kv_caches, before) for b in torch.nonzero(k != k0)[:, 0]}
        assert changed <= {0, 1, 2, null_block} and {0, 1, 2} <= changed
        from infer.api.runner import StepInputs

        eager = runner.run(StepInputs(tokens, query_lens, seq_lens, tables, [6, 10], None, False))
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
