"""allowed_token_ids on SmolLM2: every output token is in the set; a set holding the greedy
output's own tokens leaves it unchanged."""

from __future__ import annotations

import pytest

from infer import SamplingParams

PROMPTS = ["Q: What is 2+2?\nA:", "The capital of France is"]
DIGITS = [216, 32, 33, 34, 35, 36, 446, 1232, 30, 198, 2]  # " ", 0-4, " =", " +", ".", newline, EOS


@pytest.mark.slow
def test_every_output_token_is_allowed(smollm2, tokens_of):
    greedy = dict(max_tokens=16, temperature=0)
    plain = tokens_of(smollm2, PROMPTS, [SamplingParams(**greedy)] * 2)
    own = [sorted(set(tokens) | {2}) for tokens in plain]
    params = [SamplingParams(**greedy, allowed_token_ids=ids) for ids in own]
    params += [SamplingParams(**greedy, allowed_token_ids=DIGITS)] * 2
    params += [SamplingParams(max_tokens=16, temperature=1.0, seed=s, allowed_token_ids=DIGITS) for s in range(2)]
    outputs = tokens_of(smollm2, PROMPTS * 3, params)
    assert outputs[:2] == plain  # the argmax was always allowed
    assert not set(plain[1]) <= set(DIGITS)  # unconstrained, the second prompt leaves the set
    for tokens in outputs[2:]:
        assert tokens and set(tokens) <= set(DIGITS), tokens
