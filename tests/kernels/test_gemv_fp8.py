"""The GEMV over e4m3 weights with a per-row scale, in Triton's interpreter, against the dequantized
reference x.float() @ (w.float() * scale[:, None]).T rounded to x's dtype.

Tolerance: the kernel sums w * x in fp32 and multiplies each row's sum by its scale; the reference
scales each weight first and sums in torch's order. The two fp32 sums differ by a few fp32 ulps of
the sum of |terms|, which can move the one rounding to x's dtype by one of its ulps and no more:
rtol one ulp of x's dtype (2^-10 fp16, 2^-7 bf16; the interpreter also rounds bf16 toward zero,
the GPU to nearest, still within the ulp), atol for sums that cancel to near zero."""

import pytest
import torch

triton_gemv = pytest.importorskip("infer.kernels.gemv")
from infer.distributed.all_reduce.lamport import RESET, PushTarget  # noqa: E402
from infer.kernels import layers as triton_layers  # noqa: E402
from infer.plugins.layer import torch_layers as plain  # noqa: E402

ULP = {torch.float16: 2**-10, torch.bfloat16: 2**-7}
# (N, K): N not a multiple of the interpreter's BLOCK_N (4), K not one of its BLOCK_K (32); whole tiles
SHAPES = [(13, 70), (7, 33), (64, 96), (5, 1)]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as e4m3 [N, K] and a float32 scale [N]: each row's largest |w| becomes e4m3's 448."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 448.0
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ (w8.float() * scale[:, None]).T).to(x.dtype)


def assert_close(got, expected):
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=ULP[expected.dtype])


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_gemv_is_the_dequantized_product(n, k, dtype):
    torch.manual_seed(0)
    w8, scale = quantize_rows(torch.randn(n, k) / k**0.5)
    x = torch.randn(1, k, dtype=dtype)
    got = triton_gemv.gemv(x, w8, scale=scale)
    assert got.shape == (1, n) and got.dtype == dtype
    assert_close(got, reference(x, w8, scale))
    # the scale multiplies each row's sum: another scale gives another result
    assert not torch.equal(triton_gemv.gemv(x, w8, scale=2 * scale), got)


@pytest.mark.parametrize("n,k", SHAPES[:3])
def test_fp8_gated_gemv_reads_silu_and_mul_inside(n, k):
    torch.manual_seed(1)
    dtype = torch.float16  # the interpreter multiplies bfloat16 wrongly in the activation; the GPU tests take it
    w8, scale = quantize_rows(torch.randn(n, k) / k**0.5)
    h = torch.randn(1, 2 * k, dtype=dtype)
    got = triton_gemv.gemv_silu_mul(h, w8, scale=scale)
    assert torch.equal(got, triton_gemv.gemv(triton_layers.silu_and_mul(h), w8, scale=scale))
    assert_close(got, reference(plain.SiluAndMul()(h), w8, scale))


def test_fp8_partial_sum_is_pushed_as_the_plain_result():
    """Tensor parallelism: the scaled sum is what goes into every rank's exchange slot."""
    torch.manual_seed(2)
    world, n, k, dtype = 2, 12, 64, torch.float16
    slots = [torch.full((world, n), RESET, dtype=torch.int16).view(dtype) for _ in range(world)]
    peers = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64)
    w8, scale = quantize_rows(torch.randn(n, k) / k**0.5)
    x = torch.randn(1, k, dtype=dtype)
    part = triton_gemv.gemv(x, w8, push=PushTarget(peers, n, slots[1][1].view(1, n)), scale=scale)
    expected = triton_gemv.gemv(x, w8, scale=scale)
    assert torch.equal(part, expected)
    for holder in range(world):
        assert torch.equal(slots[holder][1], expected[0]) and (slots[holder][0].view(torch.int16) == RESET).all()


def test_a_scale_goes_with_an_fp8_weight_and_only_with_one():
    x, w = torch.randn(1, 32, dtype=torch.float16), torch.randn(8, 32)
    w8, scale = quantize_rows(w)
    with pytest.raises(AssertionError, match="takes its per-row scale"):
        triton_gemv.gemv(x, w8)
    with pytest.raises(AssertionError, match="weight takes none"):
        triton_gemv.gemv(x, w.half(), scale=scale)
    with pytest.raises(AssertionError, match="contiguous float32"):
        triton_gemv.gemv_silu_mul(torch.randn(1, 64, dtype=torch.float16), w8, scale=scale[:4])
