"""Acceptance rules: greedy prefix matching, and rejection sampling whose output follows the target.

The statistical tests draw many rows at once (each row a request with its own seed) and compare
the emitted tokens' histogram with the target's distribution by a chi-square test at p = 0.001.
"""

from __future__ import annotations

import pytest
import torch

from infer.api.request import Request, SamplingParams
from infer.plugins.decoding import rejection
from infer.plugins.sampler.naive import NaiveSampler
from infer.plugins.sampler.vectorized import VectorizedSampler

# chi-square critical values at p = 0.001, by degrees of freedom (no scipy needed)
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of `tokens` against `probs` [V]; tokens outside the support fail."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token the target gives no mass"
    stat = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    return stat, CHI2_CRITICAL[int(support.sum()) - 1]


def test_greedy_accept_takes_the_matching_prefix_then_the_targets_token():
    x = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [7, 0, 0], [5, 5, 5]])
    num_draft = torch.tensor([3, 3, 3, 1, 0])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 8, 4], [1, 2, 3, 4], [7, 6, 0, 0], [6, 0, 0, 0]])
    n, nxt = rejection.greedy_accept(x, num_draft, target)
    assert n.tolist() == [3, 2, 1, 1, 0]  # all; up to a mismatch; first only; all of a short row; none
    assert nxt.tolist() == [4, 8, 2, 6, 6]  # bonus; the target's correction; ...


def test_greedy_accept_ignores_padding_past_a_rows_draft():
    x = torch.tensor([[4, 4, 4]])
    n, nxt = rejection.greedy_accept(x, torch.tensor([1]), torch.tensor([[4, 4, 4, 4]]))
    assert n.tolist() == [1] and nxt.tolist() == [4]


def _rows(num_rows: int, K: int, p: torch.Tensor, q: torch.Tensor | None, seed0: int):
    # p: [K + 1, V], q: [K, V]; every row a request with its own seed, drafts drawn from q
    seeds = rejection.seed_tensor(list(range(seed0, seed0 + num_rows)), "cpu")
    positions = torch.zeros(num_rows, dtype=torch.int64)
    P = p.expand(num_rows, *p.shape)
    if q is None:
        return seeds, positions, P, None, torch.zeros(num_rows, K, dtype=torch.int64)  # always propose token 0
    draft_seeds = rejection.seed_tensor(
        [rejection.salted(s, rejection.DRAFT_SALT) for s in range(seed0, seed0 + num_rows)], "cpu"
    )
    x = torch.stack([rejection.draw(q[j].expand(num_rows, -1), draft_seeds, positions + j) for j in range(K)], dim=1)
    return seeds, positions, P, q.expand(num_rows, *q.shape), x


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_emits_the_targets_distribution(deterministic_draft):
    torch.manual_seed(0)
    R, K, V = 40_000, 3, 7
    p = torch.softmax(torch.randn(K + 1, V) * 1.2, dim=-1)  # a different target at every position
    p[1, 5] = 0.0  # a token the target never emits at index 1
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.softmax(torch.randn(K, V) * 1.5, dim=-1)  # deliberately unlike p
    seeds, positions, P, Q, x = _rows(R, K, p, None if deterministic_draft else q, seed0=1000)
    n, nxt = rejection.rejection_sample(x, torch.full((R,), K), P, Q, seeds, positions)
    assert 0 < n.float().mean() < K  # some accepted, some rejected
    for index in range(2):  # token `index` of each row that emitted it (n >= index), against p[index]
        tokens = torch.where(n > index, x[:, index], nxt)[n >= index]
        stat, critical = chi_square(tokens, p[index])
        assert stat < critical, (index, stat, critical)


def test_rejection_sampling_with_equal_draft_and_target_accepts_everything():
    R, K, V = 2000, 4, 9
    p = torch.softmax(torch.randn(K + 1, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    seeds, positions, P, Q, x = _rows(R, K, p, p[:K], seed0=5)
    n, nxt = rejection.rejection_sample(x, torch.full((R,), K), P, Q, seeds, positions)
    assert n.tolist() == [K] * R
    stat, critical = chi_square(nxt, p[K])  # the bonus token follows p at index K
    assert stat < critical


def test_rejection_sampling_is_reproducible_and_respects_each_rows_draft_length():
    R, K, V = 500, 4, 5
    p = torch.full((K + 1, V), 1.0 / V)
    seeds, positions, P, Q, x = _rows(R, K, p, torch.full((K, V), 1.0 / V), seed0=7)
    num_draft = torch.arange(R) % (K + 1)
    a = rejection.rejection_sample(x, num_draft, P, Q, seeds, positions)
    b = rejection.rejection_sample(x, num_draft, P, Q, seeds, positions)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert (a[0] <= num_draft).all() and (a[0] == num_draft).all()  # p == q: everything within k accepted


def _requests(n: int, **params) -> list[Request]:
    return [
        Request(request_id=str(i), prompt_token_ids=[1, 2, 3], params=SamplingParams(**params), arrival=i, seed=i)
        for i in range(n)
    ]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("sampler_cls", [VectorizedSampler, NaiveSampler])
def test_sampler_probs_is_the_distribution_sample_draws_from(sampler_cls):
    V, R = 12, 20_000 if sampler_cls is VectorizedSampler else 3000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)).expand(R, V).contiguous()
    requests = _requests(R, temperature=0.7, top_k=8, top_p=0.95, min_p=0.02)
    sampler = sampler_cls(V, torch.device("cpu"))
    probs = sampler.probs(logits[:1], requests[:1])[0]
    assert torch.allclose(probs.sum(), torch.tensor(1.0)) and (probs == 0).sum() >= V - 8  # top-k applied
    tokens = torch.tensor(sampler.sample(logits, requests, [0] * R).token_ids)
    stat, critical = chi_square(tokens, probs)
    assert stat < critical


def test_sampler_probs_agree_across_samplers_with_penalties_and_greedy_rows():
    V = 50
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 2
    requests = _requests(
        2, temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
    )
    requests += _requests(2, temperature=0.0, repetition_penalty=1.5)
    for r in requests:
        r.output_token_ids = [int(logits[0].argmax()), 7, 7]
    a = VectorizedSampler(V, torch.device("cpu")).probs(logits, requests)
    b = NaiveSampler(V, torch.device("cpu")).probs(logits, requests)
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(a[2:].sum(dim=-1), torch.ones(2)) and ((a[2:] == 1).sum(dim=-1) == 1).all()  # one-hot
    greedy = VectorizedSampler(V, torch.device("cpu")).sample(logits[2:], requests[2:]).token_ids
    assert a[2:].argmax(dim=-1).tolist() == greedy


def test_sampler_logprobs_report_what_sample_reports():
    V = 40
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    requests = _requests(3, temperature=0.0, logprobs=3, repetition_penalty=1.2)
    requests[1].params.logprobs = None
    for sampler in (VectorizedSampler(V, torch.device("cpu")), NaiveSampler(V, torch.device("cpu"))):
        out = sampler.sample(logits, requests)
        found = sampler.logprobs(logits, requests, out.token_ids)
        assert found[1] == {}
        for i in (0, 2):
            assert found[i].keys() == out.logprobs[i].keys()
            assert all(abs(found[i][t] - out.logprobs[i][t]) < 1e-5 for t in found[i])
