"""KV allocator conformance: a hypothesis state machine over allocate / grow / free / preempt /
resume, checking after every step that no block leaks, no block has two owners, a refused
allocation changed nothing, and usage() agrees."""

from __future__ import annotations

import pytest

from infer.testing import kit
from infer.testing.allocator import check_allocator


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" in metafunc.fixturenames:
        metafunc.parametrize(
            ("strategy", "device"), [kit.param(s, id="") for s in kit.strategies(metafunc.config, "kv_allocator")]
        )


def test_invariants_hold(strategy, device) -> None:
    declared = strategy.capabilities.block_sizes
    check_allocator(strategy.name, strategy.factory, sorted(declared)[:4] if declared else None)
