import pytest
import torch

from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.attention import BATCH_SPECS, check_backend, make_case


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_matches_naive(batch_spec, heads, block_size):
    case = make_case(batch_spec, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size, seed=7)
    check_backend(TorchAttention, case, atol=1e-5, rtol=1e-5)


def test_torch_backend_bf16():
    case = make_case(BATCH_SPECS[-1], dtype=torch.bfloat16)
    check_backend(TorchAttention, case, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_torch_backend_sliding_window(batch_spec, window):
    """Each query sees only its last `window` positions: windows shorter than a block, across
    blocks, and longer than every sequence (then it changes nothing)."""
    case = make_case(batch_spec, block_size=4, seed=3, window=window)
    check_backend(TorchAttention, case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_soft_cap(window):
    case = make_case(BATCH_SPECS[-1], seed=5, window=window, soft_cap=2.0)
    check_backend(TorchAttention, case, atol=1e-5, rtol=1e-5)


def test_the_oracle_sees_the_window():
    """The window must change the oracle's output (a window that masks nothing would prove nothing)."""
    from infer.testing.attention import naive_attention

    case = make_case(BATCH_SPECS[-1], seed=3, window=2)
    full = make_case(BATCH_SPECS[-1], seed=3)
    assert not torch.allclose(naive_attention(case), naive_attention(full))
