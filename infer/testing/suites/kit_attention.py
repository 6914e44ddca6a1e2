"""Attention conformance: every named batch spec the backend's phases allow, with randomly permuted
block tables, MHA/GQA/MQA, the block sizes it declares, against the naive oracle; on a GPU, CUDA
graph capture and replay when the backend declares `cuda_graph_safe`."""

from __future__ import annotations

import pytest
import torch

from infer.testing import kit
from infer.testing.attention import make_case
from infer.testing.attention_kit import HEADS, check_attention, check_cuda_graph, kit_cases, tolerance


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kit_case" not in metafunc.fixturenames:
        return
    graphs = metafunc.function.__name__ == "test_cuda_graph_replay"
    params = []
    for strategy in kit.strategies(metafunc.config, "attention"):
        for case in kit_cases(strategy.capabilities, kit.dtype_for(strategy)):
            if graphs and any(q != 1 for q in case.batch_spec.query_lens):
                continue
            params.append(kit.param(strategy, case, id=case.id))
    metafunc.parametrize(("strategy", "device", "kit_case"), params)


def _case(kit_case, device: torch.device):
    num_heads, num_kv_heads = HEADS[kit_case.heads]
    return make_case(
        kit_case.batch_spec,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=kit_case.block_size,
        dtype=kit_case.dtype,
        device=device,
        seed=7,
    )


def test_matches_the_reference(strategy, device, kit_case) -> None:
    check_attention(
        strategy.name, strategy.factory, _case(kit_case, device), kit_case.describe(), tolerance(kit_case.dtype)
    )


def test_cuda_graph_replay(strategy, device, kit_case) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    if not strategy.capabilities.cuda_graph_safe:
        pytest.skip(f"attention backend {strategy.name} does not declare cuda_graph_safe")
    check_cuda_graph(
        strategy.name, strategy.factory, _case(kit_case, device), kit_case.describe(), tolerance(kit_case.dtype)
    )
