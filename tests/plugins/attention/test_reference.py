import pytest
import torch

from infer.api.kv_cache import FP8
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


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)], ids=["unit-scales", "scaled"])
def test_torch_backend_fp8_cache(batch_spec, scales):
    """New K/V are written quantized (clamp(x / scale) as e4m3) and the context is read back times its
    scale: the oracle over the values the cache holds, to fp32 tolerance."""
    case = make_case(batch_spec, num_kv_heads=2, block_size=4, seed=7, kv_cache_dtype=FP8, kv_scales=scales)
    check_backend(TorchAttention, case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_fp8_cache_bf16_capped(window):
    case = make_case(BATCH_SPECS[-1], dtype=torch.bfloat16, seed=5, window=window, soft_cap=2.0,
                     kv_cache_dtype=FP8, kv_scales=(0.5, 3.0))  # fmt: skip
    check_backend(TorchAttention, case, atol=2e-2, rtol=2e-2)


def test_an_fp8_case_holds_the_unquantized_values_rounded():
    """The FP8 oracle is not the unquantized one (else matching it would prove nothing), and differs
    from it by e4m3's rounding only: 2^-4 relative, 2^-10 x scale below 2^-6 x scale."""
    scales = (0.5, 2.0)
    fp8 = make_case(BATCH_SPECS[-1], seed=3, kv_cache_dtype=FP8, kv_scales=scales)
    exact = make_case(BATCH_SPECS[-1], seed=3)
    assert torch.equal(fp8.k, exact.k) and torch.equal(fp8.q, exact.q)  # the same draws
    for dense, exact_dense, scale in ((fp8.dense_k, exact.dense_k, 0.5), (fp8.dense_v, exact.dense_v, 2.0)):
        for a, b in zip(dense, exact_dense):
            assert not torch.equal(a, b)
            torch.testing.assert_close(a, b, rtol=2**-4, atol=2**-10 * scale)
    assert fp8.kv_cache.k_scale == 0.5 and fp8.kv_cache[0].dtype == FP8 and fp8.spec.kv_cache_dtype == FP8
