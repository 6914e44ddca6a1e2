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
