"""Fused Triton layers against the plain torch layers (CPU: Triton's interpreter; GPU: tests/gpu)."""

import pytest
import torch

from infer.api.rope import Rope, rope_for
from infer.plugins.layer import torch_layers as plain

triton_layers = pytest.importorskip("infer.kernels.layers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    torch.manual_seed(0)
    ref = plain.RMSNorm(96, 1e-5)
    with torch.no_grad():
        ref.weight.normal_()
    ref = ref.to(dtype)
    x, r = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    if with_residual:
        out, res = triton_layers.rms_norm(x, ref.weight, ref.eps, r)
        exp_out, exp_res = ref(x, r)
        torch.testing.assert_close(res, exp_res, atol=0, rtol=0)
    else:
        out, exp_out = triton_layers.rms_norm(x, ref.weight, ref.eps), ref(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, exp_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_rotary_on_fused_qkv_views(heads):
    torch.manual_seed(0)
    num_q, num_k, dim = heads[0], heads[1], 32
    ref = plain.RotaryEmbedding(Rope.default(dim, 10000.0), 64)
    qkv = torch.randn(7, (num_q + 2 * num_k) * dim)
    q, k, _ = qkv.split([num_q * dim, num_k * dim, num_k * dim], dim=-1)
    q, k = q.view(7, num_q, dim), k.view(7, num_k, dim)
    pos = torch.tensor([0, 1, 5, 9, 33, 2, 63])
    got_q, got_k = triton_layers.rotary(pos, q, k, ref.cos, ref.sin)
    exp_q, exp_k = ref(pos, q, k)
    torch.testing.assert_close(got_q, exp_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, exp_k, atol=1e-5, rtol=1e-5)


def test_silu_and_mul():
    torch.manual_seed(0)
    x = torch.randn(6, 2 * 200)
    torch.testing.assert_close(triton_layers.silu_and_mul(x), plain.SiluAndMul()(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_and_mul(dtype):
    torch.manual_seed(0)
    x = (torch.randn(6, 2 * 200) * 4).to(dtype)  # into both tails of the tanh
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(triton_layers.gelu_and_mul(x), plain.GeluAndMul()(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("n,k", [(13, 70), (64, 96), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_linear(n, k, dtype):
    from infer.kernels.gemv import gemv

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype)
    x = torch.randn(1, k, dtype=dtype)
    expected = (x.double() @ w.double().t()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gemv(x, w), expected, atol=tol, rtol=tol)


def test_fused_linear_takes_gemv_for_one_token_only():
    from infer.plugins.layer.fused import FusedLinear

    torch.manual_seed(0)
    layer = FusedLinear(40, 24)
    ref = torch.nn.functional.linear
    one, many = torch.randn(1, 40), torch.randn(3, 40)
    torch.testing.assert_close(layer(one), ref(one, layer.weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(many), ref(many, layer.weight), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("n,k", [(13, 70), (64, 96), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_silu_mul_is_silu_and_mul_then_gemv(n, k, dtype):
    from infer.kernels.gemv import gemv, gemv_silu_mul

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    h = torch.randn(1, 2 * k, dtype=dtype)
    two_kernels = gemv(triton_layers.silu_and_mul(h), w)
    assert torch.equal(gemv_silu_mul(h, w), two_kernels)  # the same rounding, so the same bits
    expected = (plain.SiluAndMul()(h.double()) @ w.double().t()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(two_kernels, expected, atol=tol, rtol=tol)


def test_mlp_reads_its_activation_inside_the_down_gemv(monkeypatch):
    """One token: the Llama MLP's SiLU-and-mul and down projection are one GEMV (fused layers at
    tp 1 and on a tensor-parallel shard); more tokens, or another linear layer, keep two steps."""
    import types

    from infer.api import Layers
    from infer.distributed.layers import RowParallelLinear, Shard
    from infer.kernels import gemv as triton_gemv
    from infer.plugins.layer.fused import FusedLinear, FusedRMSNorm, FusedRotaryEmbedding, FusedSiluAndMul
    from infer.plugins.model.transformer import MLP

    calls = []
    real = triton_gemv.gemv_silu_mul
    monkeypatch.setattr(triton_gemv, "gemv_silu_mul", lambda h, w, push=None: calls.append(h.shape) or real(h, w, push))
    config = types.SimpleNamespace(hidden_size=32, intermediate_size=48)
    fused = Layers(
        rms_norm=FusedRMSNorm, rotary_embedding=FusedRotaryEmbedding, silu_and_mul=FusedSiluAndMul, linear=FusedLinear
    )
    torch.manual_seed(0)
    mlp = MLP(config, fused)
    assert mlp.fused_down
    for tokens, fused_calls in ((1, 1), (3, 0)):
        calls.clear()
        x = torch.randn(tokens, 32)
        expected = plain.SiluAndMul()(x @ mlp.gate_up_proj.weight.t()) @ mlp.down_proj.weight.t()
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)
        assert len(calls) == fused_calls
    # a shard whose partial sum is left to the next norm: fused; one that all-reduces itself, or
    # another linear layer's matmul: not
    parallel = types.SimpleNamespace(all_reduce=lambda y: y)
    shard = Shard(1, (48,), ((0, 48),))
    assert FusedSiluAndMul.fuses_with(RowParallelLinear(32, shard, parallel, FusedLinear.matmul, reduce=False))
    assert not FusedSiluAndMul.fuses_with(RowParallelLinear(32, shard, parallel, FusedLinear.matmul, reduce=True))
    assert not FusedSiluAndMul.fuses_with(
        RowParallelLinear(32, shard, parallel, torch.nn.functional.linear, reduce=False)
    )
    assert not FusedSiluAndMul.fuses_with(plain.Linear(48, 32))
    assert not FusedSiluAndMul.fuses_with(FusedLinear(48, 32, bias=True))


def test_attention_rotates_in_the_cache_write_where_the_backend_can():
    """Fused layers over paged-cuda: the rotary embedding is applied by the backend's cache write
    (one kernel), with the output and cache of the layer rotating first; a plain rotary layer, or a
    backend without `forward_with_rotary`, rotates first."""
    import types

    from infer.api import Layers
    from infer.plugins.attention.paged_cuda import PagedCudaAttention
    from infer.plugins.attention.torch_backend import TorchAttention
    from infer.plugins.layer.fused import FusedLinear, FusedRMSNorm, FusedRotaryEmbedding, FusedSiluAndMul
    from infer.plugins.model.transformer import Attention
    from infer.testing.attention import BatchSpec, make_case

    case = make_case(BatchSpec("mixed", (1, 5), (9, 3)), num_heads=4, num_kv_heads=2, head_dim=16)
    # yarn: cos and sin carry an attention scaling, which the cache write must apply as the layer does
    yarn = rope_for(
        dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16), 16, 32, 4, 64
    )
    assert yarn.attention_scaling != 1.0
    config = types.SimpleNamespace(
        hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, rope=lambda: yarn
    )
    fused = Layers(
        rms_norm=FusedRMSNorm, rotary_embedding=FusedRotaryEmbedding, silu_and_mul=FusedSiluAndMul, linear=FusedLinear
    )
    torch.manual_seed(0)
    layer = Attention(config, fused, PagedCudaAttention(case.spec))
    assert layer.rotary_in_attention
    assert not Attention(config, plain_layers(), PagedCudaAttention(case.spec)).rotary_in_attention
    assert not Attention(config, fused, TorchAttention(case.spec)).rotary_in_attention
    x = torch.randn(6, 32)
    positions = torch.tensor([9, 3, 4, 5, 6, 7])
    outs, caches = [], []
    for rotary_in_attention in (True, False):
        layer.rotary_in_attention = rotary_in_attention
        kv_cache = tuple(c.clone() for c in case.kv_cache)
        layer.attention.plan(case.batch)
        outs.append(layer(positions, x, kv_cache))
        caches.append(kv_cache)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def plain_layers():
    from infer.api import Layers

    return Layers(
        rms_norm=plain.RMSNorm,
        rotary_embedding=plain.RotaryEmbedding,
        silu_and_mul=plain.SiluAndMul,
        linear=plain.Linear,
    )


def test_fused_rotary_serves_head_dims_whose_half_is_not_a_power_of_two():
    """Phi-3's head_dim 96 (half 48): the kernel's tiles cannot take it, so the layer rotates in torch."""
    from infer.plugins.layer.fused import FusedRotaryEmbedding

    torch.manual_seed(0)
    rope = Rope.default(96, 10000.0)
    ref, fused = plain.RotaryEmbedding(rope, 64), FusedRotaryEmbedding(rope, 64)
    q, k = torch.randn(5, 4, 96), torch.randn(5, 2, 96)
    pos = torch.tensor([0, 3, 17, 40, 63])
    for got, exp in zip(fused(pos, q, k), ref(pos, q, k)):
        torch.testing.assert_close(got, exp, atol=0, rtol=0)


def test_several_rows_take_the_gemv_only_while_warming_up(monkeypatch):
    # a verify step's rows (2 to 8) go through the GEMV where its tile for that row count was tuned in
    # the graph warm-up; an eager step of a new row count stays on the GEMM rather than tuning mid-run
    from infer.kernels import gemv as gemv_module
    from infer.kernels import warmup
    from infer.plugins.layer import fused

    torch.manual_seed(0)
    x, h, w = torch.randn(5, 64), torch.randn(5, 2 * 64), torch.randn(48, 64)
    calls = []
    gemv, gated = gemv_module.gemv, gemv_module.gemv_silu_mul
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append("gemv") or gemv(*a, **k))
    monkeypatch.setattr(gemv_module, "gemv_silu_mul", lambda *a, **k: calls.append("gated") or gated(*a, **k))
    expected = torch.nn.functional.linear(x, w)
    expected_down = torch.nn.functional.linear(plain.SiluAndMul()(h), w)
    act = fused.FusedSiluAndMul()
    torch.testing.assert_close(fused._matmul(x, w), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(act.down(h, w), expected_down, atol=1e-5, rtol=1e-5)
    assert calls == []
    with warmup.warming_up():
        assert warmup.is_warming_up()
        torch.testing.assert_close(fused._matmul(x, w), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(act.down(h, w), expected_down, atol=1e-5, rtol=1e-5)
        assert fused._matmul(torch.randn(9, 64), w).shape == (9, 48)
    assert calls == ["gemv", "gated"] and not warmup.is_warming_up()  # 9 rows: past GEMV_MAX_ROWS
