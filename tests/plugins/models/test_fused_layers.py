"""Fused Triton layers against the plain torch layers (CPU: Triton's interpreter; GPU: tests/gpu)."""

import pytest
import torch

from infer.plugins.models import layers as plain

triton_layers = pytest.importorskip("infer.plugins.models.triton_layers")


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
    ref = plain.RotaryEmbedding(dim, 64, 10000.0, None)
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


@pytest.mark.parametrize("n,k", [(13, 70), (64, 96), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_linear(n, k, dtype):
    from infer.plugins.models.triton_gemv import gemv

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype)
    x = torch.randn(1, k, dtype=dtype)
    expected = (x.double() @ w.double().t()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gemv(x, w), expected, atol=tol, rtol=tol)


def test_fused_linear_takes_gemv_for_one_token_only():
    from infer.plugins.models.fused_layers import FusedLinear

    torch.manual_seed(0)
    layer = FusedLinear(40, 24)
    ref = torch.nn.functional.linear
    one, many = torch.randn(1, 40), torch.randn(3, 40)
    torch.testing.assert_close(layer(one), ref(one, layer.weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(many), ref(many, layer.weight), atol=1e-5, rtol=1e-5)
