import dataclasses
import math
import random
from collections import Counter

import pluggy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.api import hookspecs
from infer.api.request import Request, SamplingParams
from infer.kernels import rng
from infer.plugins.sampler import naive, vectorized
from infer.testing.sampling import (
    CHI2_P001,
    DISTRIBUTION_CASES,
    LOGITS8,
    chi_square,
    draw,
    make_request,
    ref_distribution,
)

CPU = torch.device("cpu")


def _registry() -> dict[str, type]:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(naive)
    pm.register(vectorized)
    found: dict[str, type] = {}
    pm.hook.infer_register_samplers(register=found.__setitem__)
    return found


SAMPLERS = _registry()


@pytest.fixture(params=sorted(SAMPLERS))
def factory(request):
    return SAMPLERS[request.param]


# --------------------------------------------------------------------------- pure-Python reference


def ref_penalised(logits: list[float], r: Request) -> list[float]:
    p = r.params
    out = list(logits)
    if p.repetition_penalty != 1.0:
        for t in set(r.all_token_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def ref_log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    lse = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - lse for x in logits]


# --------------------------------------------------------------------------- registry and RNG


def test_both_samplers_registered():
    assert set(SAMPLERS) == {"vectorized", "naive"}


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(-(2**63), 2**64 - 1), position=st.integers(0, 2**20), token=st.integers(0, 2**18))
def test_tensor_hash_matches_integer_reference(seed, position, token):
    seeds = torch.tensor([rng.split_seed(seed)], dtype=torch.int64)
    key, mult = rng.row_keys(seeds, torch.tensor([position]))
    h = rng.token_hash(key, mult, torch.tensor([token, 0, 2**18]))
    assert h.tolist() == [[rng.token_hash_int(seed, position, t) for t in (token, 0, 2**18)]]


def test_lowbias32_reference_values():
    xs = [0, 1, 2, 0xDEADBEEF, 2**31, 2**32 - 1]
    assert rng.lowbias32(torch.tensor(xs)).tolist() == [rng.lowbias32_int(x) for x in xs]
    # from the C reference with uint32_t arithmetic
    assert [rng.lowbias32_int(x) for x in (1, 0xDEADBEEF, 2**32 - 1)] == [0x688990C0, 0xE628C683, 0x6768824A]


def test_exponential_noise_is_positive_and_finite_at_the_extremes():
    e = rng.hash_to_exponential(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert torch.isfinite(e).all() and (e > 0).all()
    assert e[-1] < e[-2] < e[2] < e[1] < e[0]


# --------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax(factory):
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    reqs = [make_request(i, SamplingParams(temperature=0.0), seed=i) for i in range(64)]
    out = factory(100, CPU).sample(logits, reqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("method", ["sample", "sample_tokens"])
def test_greedy_reads_strided_logits_and_leaves_them_as_they_were(factory, method):
    """Logits that are a slice of wider rows (a tensor-parallel vocabulary's gathered columns), greedy
    rows with and without a penalty beside them: each row's argmax after its penalty, and the caller's
    logits untouched."""
    if not hasattr(factory, method):
        pytest.skip(f"{factory.__name__} has no {method}")
    wide = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)) * 0.1
    wide[2, 4], wide[2, 7] = 1.5, 1.0  # row 2: 4 first, 7 once 4 is penalised by 2
    logits = wide[:, :10]
    before = logits.clone()
    plain = [make_request(i, SamplingParams(temperature=0.0)) for i in range(3)]
    penalised = [*plain[:2], make_request(2, SamplingParams(temperature=0.0, presence_penalty=2.0), output=[4])]
    for reqs, last in ((plain, 4), (penalised, 7)):
        got = getattr(factory(10, CPU), method)(logits, reqs)
        tokens = got.token_ids if method == "sample" else got.tolist()
        assert tokens == [*logits[:2].argmax(dim=-1).tolist(), last]
        assert torch.equal(logits, before)


def test_greedy_applies_penalties(factory):
    logits = [2.7, 2.9, -0.5, 1.9, 2.0, 0.5]
    negative = [-1.0, -0.2, -0.3, -2.0, -0.9, -1.5]
    all_three = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    openai_style = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5)
    reqs = [
        # 2.7/1.5=1.8, 2.9/1.5-2*0.2-0.3=1.233, -0.5*1.5, 1.9, 2.0/1.5-0.2-0.3=0.833, 0.5 -> 3
        make_request(0, all_three, prompt=[0, 2], output=[1, 1, 4]),
        # 2.7, 2.9-2*0.5-1.0=0.9, -0.5, 1.9, 2.0-0.5-1.0=0.5, 0.5 -> 0
        make_request(1, openai_style, prompt=[0], output=[1, 1, 4]),
        # negative logits are multiplied: -0.2*2=-0.4 < -0.3 -> 2
        make_request(2, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1]),
    ]
    out = factory(6, CPU).sample(torch.tensor([logits, logits, negative]), reqs)
    assert out.token_ids == [3, 0, 2]


# --------------------------------------------------------------------------- exact distributions


@pytest.mark.parametrize("vary", ["seed", "position"])
@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
@pytest.mark.parametrize(
    "factory",
    [  # the per-row loop of naive draws 5x slower than vectorized
        pytest.param(SAMPLERS[name], id=name, marks=[pytest.mark.slow] if name == "naive" else [])
        for name in sorted(SAMPLERS)
    ],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_sampled_distribution_is_exact(factory, case, vary):
    params = DISTRIBUTION_CASES[case]
    probs = ref_distribution(LOGITS8, params)
    counts = Counter(draw(factory, params, vary))
    assert all(probs[t] > 0 for t in counts), f"drew a filtered token: {counts}, target {probs}"
    stat, dof = chi_square([counts[t] for t in range(8)], probs)
    assert stat < CHI2_P001[dof], f"chi2={stat:.1f} dof={dof}: {sorted(counts.items())}, target {probs}"


def test_reference_filters_cut_where_expected():
    kept = {
        name: [t for t, q in enumerate(ref_distribution(LOGITS8, p)) if q > 0] for name, p in DISTRIBUTION_CASES.items()
    }
    assert kept["temperature"] == list(range(8))
    assert kept["top_k"] == [1, 3, 5]
    assert kept["top_p"] == [1, 3, 5]
    assert kept["min_p"] == [0, 1, 3, 5, 7]
    assert 1 < len(kept["combined"]) < 5


# --------------------------------------------------------------------------- seeds


def _mixed_requests(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[Request], list[int]]:
    rnd = random.Random(seed)
    reqs = []
    for i in range(n):
        params = SamplingParams(
            temperature=rnd.choice([0.0, 0.5, 1.0, 1.3]),
            top_k=rnd.choice([0, 0, 3, 10]),
            top_p=rnd.choice([1.0, 1.0, 0.9, 0.5]),
            min_p=rnd.choice([0.0, 0.0, 0.1]),
            repetition_penalty=rnd.choice([1.0, 1.0, 1.2, 0.8]),
            presence_penalty=rnd.choice([0.0, 0.0, 0.5, -0.5]),
            frequency_penalty=rnd.choice([0.0, 0.0, 0.3]),
            logprobs=rnd.choice([None, None, 0, 2, 5]),
        )
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 12))]
        output = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 8))]
        reqs.append(make_request(i, params, seed=rnd.getrandbits(64), prompt=prompt, output=output))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    positions = [len(r.output_token_ids) + rnd.randrange(3) for r in reqs]
    return logits, reqs, positions


def test_same_seed_same_token_in_any_batch(factory):
    vocab = 50
    logits, reqs, positions = _mixed_requests(8, vocab, seed=3)
    for r in reqs:
        r.params.temperature = 1.0
    sampler = factory(vocab, CPU)
    batch = sampler.sample(logits, reqs, positions).token_ids
    alone = [sampler.sample(logits[i : i + 1], [reqs[i]], [positions[i]]).token_ids[0] for i in range(8)]
    assert alone == batch
    for perm_seed in range(3):
        perm = random.Random(perm_seed).sample(range(8), 8)
        permuted = sampler.sample(logits[perm], [reqs[i] for i in perm], [positions[i] for i in perm])
        assert permuted.token_ids == [batch[i] for i in perm]
    others, other_reqs, other_positions = _mixed_requests(7, vocab, seed=4)
    for i in range(8):
        rows = torch.cat([others[:5], logits[i : i + 1], others[5:]])
        row_reqs = [*other_reqs[:5], reqs[i], *other_reqs[5:]]
        mixed = sampler.sample(rows, row_reqs, [*other_positions[:5], positions[i], *other_positions[5:]])
        assert mixed.token_ids[5] == batch[i]


def test_positions_and_seeds_give_different_streams(factory):
    vocab, n = 50, 40
    logits = torch.zeros(n, vocab)
    by_position = [make_request(i, SamplingParams(), seed=99) for i in range(n)]
    by_seed = [make_request(i, SamplingParams(), seed=i) for i in range(n)]
    sampler = factory(vocab, CPU)
    assert len(set(sampler.sample(logits, by_position, list(range(n))).token_ids)) > 15
    assert len(set(sampler.sample(logits, by_seed, [0] * n).token_ids)) > 15


def test_positions_default_to_the_output_length(factory):
    logits, reqs, positions = _mixed_requests(16, 30, seed=5)
    sampler = factory(30, CPU)
    default = [len(r.output_token_ids) for r in reqs]
    assert sampler.sample(logits, reqs).token_ids == sampler.sample(logits, reqs, default).token_ids


# --------------------------------------------------------------------------- logprobs


def check_logprobs(got: dict[int, float], token: int, logits: list[float], r: Request) -> None:
    k = r.params.logprobs
    if k is None:
        assert got == {}
        return
    ref = ref_log_softmax(ref_penalised(logits, r))
    kth = sorted(ref, reverse=True)[k - 1] if k else math.inf
    assert token in got and len(got) in (k, k + 1)
    assert sum(1 for t in got if ref[t] >= kth - 1e-5) >= k
    for t, lp in got.items():
        assert lp == pytest.approx(ref[t], abs=1e-5)


def test_logprobs_are_log_softmax_of_penalised_logits(factory):
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.5, top_k=2, logprobs=3, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=2.0, top_p=0.3, logprobs=12),
    ]
    prompts, outputs = [[0, 1, 2], [0], [0], [0]], [[3], [5, 5, 6], [], [1]]
    reqs = [make_request(i, params[i], seed=i + 1, prompt=prompts[i], output=outputs[i]) for i in range(4)]
    out = factory(12, CPU).sample(logits, reqs)
    assert out.logprobs is not None and len(out.logprobs) == 4
    for i, r in enumerate(reqs):
        check_logprobs(out.logprobs[i], out.token_ids[i], logits[i].tolist(), r)


def test_logprobs_beyond_the_vocab_return_every_token(factory):
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(2))
    reqs = [make_request(i, SamplingParams(logprobs=9), seed=i) for i in range(2)]
    out = factory(5, CPU).sample(logits, reqs)
    assert [sorted(d) for d in out.logprobs] == [list(range(5))] * 2


# --------------------------------------------------------------------------- a large mixed batch


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_large_mixed_batch(factory):
    vocab = 32
    logits, reqs, positions = _mixed_requests(2000, vocab, seed=11)
    out = factory(vocab, CPU).sample(logits, reqs, positions)
    assert len(out.token_ids) == 2000 and out.logprobs is not None
    for i, (r, token) in enumerate(zip(reqs, out.token_ids)):
        row = logits[i].tolist()
        penalised = ref_penalised(row, r)
        if r.params.is_greedy:
            assert penalised[token] >= max(penalised) - 1e-5
        else:
            p = r.params
            loose = dataclasses.replace(p, top_p=min(1.0, p.top_p + 1e-4), min_p=max(0.0, p.min_p - 1e-4))
            assert ref_distribution(penalised, loose)[token] > 0, f"row {i}: {r.params}"
        check_logprobs(out.logprobs[i], token, row, r)


def test_samplers_agree_on_greedy_tokens_and_logprobs():
    logits, reqs, positions = _mixed_requests(300, 64, seed=12)
    outs = {name: f(64, CPU).sample(logits, reqs, positions) for name, f in SAMPLERS.items()}
    vec, naive = outs["vectorized"], outs["naive"]
    greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
    assert [vec.token_ids[i] for i in greedy] == [naive.token_ids[i] for i in greedy]
    for i in greedy:
        assert vec.logprobs[i] == pytest.approx(naive.logprobs[i], abs=1e-6)
