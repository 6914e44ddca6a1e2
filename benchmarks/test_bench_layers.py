"""Fused layers vs plain torch layers on the GPU, at decode (64 tokens) and prefill (4096) shapes."""

import pytest
import torch

from infer.plugins.layer import torch_layers as plain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _timed(benchmark, fn):
    def run():
        fn()
        torch.cuda.synchronize()

    run()
    benchmark(run)


@pytest.mark.benchmark(group="layer-rms-norm")
@pytest.mark.parametrize("tokens", [64, 4096])
@pytest.mark.parametrize("impl", ["plain", "fused"])
def test_rms_norm_residual(benchmark, impl, tokens):
    from infer.kernels import layers as tl_layers

    norm = plain.RMSNorm(4096, 1e-5).cuda().bfloat16()
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    fn = (lambda: norm(x, r)) if impl == "plain" else (lambda: tl_layers.rms_norm(x, norm.weight, norm.eps, r))
    _timed(benchmark, fn)


@pytest.mark.benchmark(group="layer-rotary")
@pytest.mark.parametrize("tokens", [64, 4096])
@pytest.mark.parametrize("impl", ["plain", "fused"])
def test_rotary(benchmark, impl, tokens):
    from infer.kernels import layers as tl_layers

    rope = plain.RotaryEmbedding(128, 8192, 500000.0, None).cuda()
    qkv = torch.randn(tokens, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(tokens, 32, 128), k.view(tokens, 8, 128)
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    fn = (lambda: rope(pos, q, k)) if impl == "plain" else (lambda: tl_layers.rotary(pos, q, k, rope.cos, rope.sin))
    _timed(benchmark, fn)


@pytest.mark.benchmark(group="layer-silu-and-mul")
@pytest.mark.parametrize("tokens", [64, 4096])
@pytest.mark.parametrize("impl", ["plain", "fused"])
def test_silu_and_mul(benchmark, impl, tokens):
    from infer.kernels import layers as tl_layers

    h = torch.randn(tokens, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    fn = (lambda: plain.SiluAndMul()(h)) if impl == "plain" else (lambda: tl_layers.silu_and_mul(h))
    _timed(benchmark, fn)
