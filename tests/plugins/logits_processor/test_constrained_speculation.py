"""Speculative decoding with the n-gram draft gives the same greedy output as autoregressive
decoding under each plain constraint (the rows after a draft are constrained after it)."""

from __future__ import annotations

import pytest

from infer import SamplingParams

PROMPTS = [
    "Q: What is 2+2?\nA:",  # repeats itself: the n-gram draft proposes
    "List the days of the week: Monday, Tuesday,",
    "Is the sky blue? Answer yes or no:",  # ends early without min_tokens
]
CONSTRAINTS = {
    "logit_bias": dict(logit_bias={216: -100, 198: -5.0, 15083: 100}),  # " ", newline, " Wednesday"
    "bad_words": dict(bad_words=["Wednesday", "2 +", "blue"]),
    "min_tokens": dict(min_tokens=14),
    "allowed_token_ids": dict(allowed_token_ids=[216, 34, 36, 446, 1232, 198, 28, 30, 2, 15083, 14963, 787, 9805]),
}


@pytest.mark.slow
def test_greedy_output_with_the_ngram_draft_equals_autoregressive(smollm2, smollm2_ngram, tokens_of):
    prompts = PROMPTS * len(CONSTRAINTS)
    params = [SamplingParams(max_tokens=16, temperature=0, **c) for c in CONSTRAINTS.values() for _ in PROMPTS]
    before = smollm2_ngram.engine.decoder_totals.get("spec_accepted", 0)
    expected = tokens_of(smollm2, prompts, params)
    got = tokens_of(smollm2_ngram, prompts, params)
    for i, name in enumerate(n for n in CONSTRAINTS for _ in PROMPTS):
        assert got[i] == expected[i], (name, prompts[i])
    assert smollm2_ngram.engine.decoder_totals["spec_accepted"] > before  # drafts were verified and kept
    plain = tokens_of(smollm2, PROMPTS, [SamplingParams(max_tokens=16, temperature=0)] * len(PROMPTS))
    changed = {name for i, name in enumerate(n for n in CONSTRAINTS for _ in PROMPTS) if expected[i] != plain[i % 3]}
    assert changed == set(CONSTRAINTS)  # each constraint changed some output
