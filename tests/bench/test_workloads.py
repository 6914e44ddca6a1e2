"""The random-IxO workloads: any shape by name, seeded, drawn below the vocabulary."""

from __future__ import annotations

import pytest

from infer.api.errors import DatasetError
from infer.bench.workloads import load_workload, needs_vocab


def test_random_shape_by_name_is_seeded_and_in_the_vocabulary() -> None:
    w = load_workload("random-12x3", 100, 5, None, seed=7)
    assert [len(p) for p in w.prompts] == [12] * 5 and w.max_tokens == [3] * 5 and w.ignore_eos
    assert all(isinstance(t, int) and 10 <= t < 100 for p in w.prompts for t in p)
    assert load_workload("random-12x3", 100, 5, None, seed=7).prompts == w.prompts
    assert load_workload("random-12x3", 100, 5, None, seed=8).prompts != w.prompts
    assert load_workload("random-12x3", 100, 5, 9, seed=7).max_tokens == [9] * 5  # --max-tokens wins


@pytest.mark.parametrize("name", ["random-256x256", "random-1x1", "sharegpt-like", "latency-1"])
def test_token_id_workloads_need_the_vocabulary(name: str) -> None:
    assert needs_vocab(name)


@pytest.mark.parametrize("name", ["random-0x4", "random-4x", "random-256", "builtin", "prompts.jsonl"])
def test_other_names_do_not(name: str) -> None:
    assert not needs_vocab(name)


def test_a_malformed_shape_is_an_unknown_dataset() -> None:
    with pytest.raises(DatasetError, match="random-IxO"):
        load_workload("random-0x4", 100, 5, None, seed=0)
