"""Fused Triton layers on the GPU in bf16 (Triton's CPU interpreter cannot run bf16)."""

import pytest
import torch

from infer.api.rope import Rope
from infer.plugins.layer import torch_layers as plain

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_layers_match_plain(dtype):
    from infer.kernels import layers as tl_layers

    torch.manual_seed(0)
    dev = "cuda"
    norm = plain.RMSNorm(4096, 1e-5).to(dev, dtype)
    x, r = torch.randn(64, 4096, device=dev, dtype=dtype), torch.randn(64, 4096, device=dev, dtype=dtype)
    out, res = tl_layers.rms_norm(x, norm.weight, norm.eps, r)
    exp_out, exp_res = norm(x, r)
    torch.testing.assert_close(res, exp_res, atol=0, rtol=0)
    torch.testing.assert_close(out, exp_out, atol=2e-2, rtol=2e-2)
    rope = plain.RotaryEmbedding(Rope.default(128, 500000.0), 4096).to(dev)
    qkv = torch.randn(64, (32 + 16) * 128, device=dev, dtype=dtype)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(64, 32, 128), k.view(64, 8, 128)
    pos = torch.randint(0, 4096, (64,), device=dev)
    for got, exp in zip(tl_layers.rotary(pos, q, k, rope.cos, rope.sin), rope(pos, q, k)):
        torch.testing.assert_close(got, exp, atol=2e-2, rtol=2e-2)
    h = torch.randn(64, 2 * 11008, device=dev, dtype=dtype)
    torch.testing.assert_close(tl_layers.silu_and_mul(h), plain.SiluAndMul()(h), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008), (32000, 4096), (1000, 576)])
def test_gemv_matches_cublas(dtype, n, k):
    from infer.kernels.gemv import gemv

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    expected = (x.double() @ w.double().t()).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gemv(x, w), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 11008), (4096, 5504), (2048, 8192)])
def test_gemv_silu_mul_matches_two_kernels(dtype, n, k):
    """The MLP's activation read inside the down GEMV: the same bits as SiLU-and-mul, then the GEMV."""
    from infer.kernels import layers as tl_layers
    from infer.kernels.gemv import gemv, gemv_silu_mul

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    h = torch.randn(1, 2 * k, device="cuda", dtype=dtype)
    assert torch.equal(gemv_silu_mul(h, w), gemv(tl_layers.silu_and_mul(h), w))


def test_gemv_tile_is_tuned_once_per_shape_before_any_capture():
    """The first call for a weight shape picks a tile among the candidates and keeps it; a first call
    inside a CUDA graph capture (where it cannot time anything) is refused with the reason."""
    from infer.kernels import gemv as triton_gemv
    from infer.kernels import gemv_tiles

    w = torch.randn(768, 1536, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    triton_gemv.gemv(x, w)
    key = (768, 1536, torch.bfloat16, torch.bfloat16, w.device, 1)
    tile = triton_gemv._tiles[key]
    assert tile in gemv_tiles.CANDIDATES
    triton_gemv.gemv(x, w)
    assert triton_gemv._tiles[key] is tile
    fresh = torch.randn(640, 1536, device="cuda", dtype=torch.bfloat16)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="must run before graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            triton_gemv.gemv(x, fresh)
