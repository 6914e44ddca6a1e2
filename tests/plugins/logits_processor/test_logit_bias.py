"""logit_bias: the samplers' distribution is softmax(logits + bias), exactly; on SmolLM2 a bias of
-100 bans a token and +100 forces it."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.api import ProcessorContext
from infer.api.constrain import admit, constrain
from infer.plugins.logits_processor.logit_bias import LogitBias
from infer.plugins.sampler.naive import NaiveSampler
from infer.plugins.sampler.vectorized import VectorizedSampler
from infer.testing.sampling import make_request

VOCAB = 1000
BIAS = {7: 100.0, 11: -100.0, 500: 2.5, 999: -0.75, 3: 0.0}


@pytest.mark.parametrize("sampler", [VectorizedSampler, NaiveSampler], ids=["vectorized", "naive"])
def test_probs_with_a_bias_are_the_softmax_of_the_biased_logits(sampler):
    cpu = torch.device("cpu")
    processor = LogitBias(ProcessorContext(None, VOCAB, frozenset({0}), cpu))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    requests = [make_request(i, SamplingParams(logit_bias=BIAS if i != 1 else None)) for i in range(3)]
    for r in requests:
        r.constraints = admit([processor], r)
    assert [bool(r.constraints) for r in requests] == [True, False, True]
    work = logits.clone()
    constrain(work, requests)
    bias = torch.zeros(VOCAB)
    bias[list(BIAS)] = torch.tensor(list(BIAS.values()))
    expected = torch.softmax(logits + torch.stack([bias, torch.zeros(VOCAB), bias]), dim=-1)
    probs = sampler(VOCAB, cpu).probs(work, requests)
    assert torch.equal(probs, expected)
    assert probs[0, 11] < 1e-40 and probs[0, 7] > 0.99  # -100 leaves nothing, +100 nearly everything


@pytest.mark.slow
def test_minus_100_is_never_sampled_and_plus_100_always(smollm2, tokens_of):
    prompts = ["The capital of France is", "My favourite fruit is"] * 2
    sampled = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed) for seed in range(4)]
    plain = tokens_of(smollm2, prompts, sampled)
    seen = sorted({t for tokens in plain for t in tokens})  # every token these draws took
    banned = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=s, logit_bias=dict.fromkeys(seen, -100)) for s in range(4)
    ]
    assert not {t for tokens in tokens_of(smollm2, prompts, banned) for t in tokens} & set(seen)
    forced = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, logit_bias={7042: 100}) for s in range(4)]
    assert tokens_of(smollm2, prompts, forced) == [[7042] * 8] * 4  # " Paris"
