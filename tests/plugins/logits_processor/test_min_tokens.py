"""min_tokens on SmolLM2: EOS (and the request's stop tokens) never come before min_tokens tokens,
on prompts whose output otherwise ends at once or within a few tokens."""

from __future__ import annotations

import pytest

from infer import SamplingParams

QUICK = "Is the sky blue? Answer yes or no:"  # greedy: 6 tokens, then EOS
YES_NO = "Reply with one word: yes or no? Answer:"  # sampled with seed 0 at 0.8: EOS first


@pytest.mark.slow
def test_eos_and_stop_tokens_never_come_before_min_tokens(smollm2, tokens_of):
    eos = smollm2.engine.parts.eos_token_ids
    greedy = dict(max_tokens=16, temperature=0)
    sampled = dict(max_tokens=16, temperature=0.8)
    prompts = [QUICK, QUICK, QUICK, QUICK, YES_NO, YES_NO, YES_NO]
    plain, held, stopped, held_stop, sampled_plain, *held_sampled = tokens_of(
        smollm2,
        prompts,
        [
            SamplingParams(**greedy),
            SamplingParams(**greedy, min_tokens=12),
            SamplingParams(**greedy, stop_token_ids=[504]),  # " The": the second token
            SamplingParams(**greedy, stop_token_ids=[504], min_tokens=4),
            SamplingParams(**sampled, seed=0),
            SamplingParams(**sampled, seed=0, min_tokens=6),
            SamplingParams(**sampled, seed=1, min_tokens=6),
        ],
    )
    assert len(plain) < 12 and plain[-1] in eos, plain  # the reference ends early
    assert len(held) >= 12 and not eos & set(held[:12]), held
    assert held[: len(plain) - 1] == plain[:-1]  # only EOS was held back
    assert stopped == plain[:2] and stopped[-1] == 504, stopped
    assert len(held_stop) >= 4 and 504 not in held_stop[:4], held_stop
    assert sampled_plain[0] in eos, sampled_plain
    for tokens in held_sampled:
        assert len(tokens) >= 6 and not eos & set(tokens[:6]), tokens
