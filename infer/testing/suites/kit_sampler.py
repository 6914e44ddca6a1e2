"""Sampler conformance: greedy = argmax; the exact distribution (chi-square) for each of
temperature, top-k, top-p and min-p the sampler declares in `supported_params`; the same seed
gives the same token in any batch composition (when it declares "seed"); `sample_tokens`, when
offered (decode pipelining), returns exactly `sample`'s tokens."""

from __future__ import annotations

import pytest

from infer.api import TokenSampler
from infer.testing import kit
from infer.testing.sampling import (
    check_distribution,
    check_greedy,
    check_sample_tokens,
    check_seeds,
    distribution_cases,
    supported_params,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" not in metafunc.fixturenames:
        return
    params = []
    for strategy in kit.strategies(metafunc.config, "sampler"):
        if "case" not in metafunc.fixturenames:
            params.append(kit.param(strategy, id=""))
            continue
        seeded = "seed" in supported_params(strategy.factory)
        for case in distribution_cases(strategy.factory):
            for vary in ("seed", "position") if seeded else ("seed",):
                params.append(kit.param(strategy, case, vary, id=f"{case}-by-{vary}"))
    names = ("strategy", "device", "case", "vary") if "case" in metafunc.fixturenames else ("strategy", "device")
    metafunc.parametrize(names, params)


def test_greedy_is_argmax(strategy, device) -> None:
    check_greedy(strategy.name, strategy.factory, device)


def test_distribution_is_exact(strategy, device, case, vary) -> None:
    check_distribution(strategy.name, strategy.factory, case, vary, device)


def test_same_seed_same_token_in_any_batch(strategy, device) -> None:
    if "seed" not in supported_params(strategy.factory):
        pytest.skip(f"sampler {strategy.name} does not declare 'seed' in supported_params")
    check_seeds(strategy.name, strategy.factory, device)


def test_sample_tokens_equals_sample(strategy, device) -> None:
    factory = strategy.factory
    if not isinstance(factory, TokenSampler):
        pytest.skip(f"sampler {strategy.name} has no sample_tokens (optional: decode pipelining)")
    check_sample_tokens(strategy.name, factory, device)
