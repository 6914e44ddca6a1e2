"""Decoder conformance: greedy output token-identical to `autoregressive` on a tiny random Llama
(with a one-layer draft for decoders that need one), with a roomy KV cache and with preemption.
A decoder that declares `lossy` is exempt."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.testing import kit
from infer.testing.decoder import SETTINGS, check_lossless, write_tiny_llamas


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "setting" in metafunc.fixturenames:
        params = [
            kit.param(s, setting, id=setting.split(" (")[0].replace(" ", "-"))
            for s in kit.strategies(metafunc.config, "decoding")
            for setting in SETTINGS
        ]
        metafunc.parametrize(("strategy", "device", "setting"), params)


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_llamas(tmp_path_factory.mktemp("infer-kit-llama"))


def test_greedy_output_is_lossless(strategy, device, setting, tiny_llamas) -> None:
    if strategy.capabilities.lossy:
        pytest.skip(f"decoder {strategy.name} declares lossy=True: it may change outputs")
    target, draft = tiny_llamas
    check_lossless(strategy.name, strategy.capabilities.needs_draft, target, draft, device, setting)
