"""The FP8 activation quantizers (`infer.kernels.fp8`, on the CPU under Triton's interpreter) against
their torch references, bit for bit, and the references against the unquantized values; the W8A8
product's CPU path against a float64 product. At Llama-3-8B's shapes on a GPU:
tests/gpu/test_fp8_kernels_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")
from infer.kernels import fp8  # noqa: E402
from infer.kernels import fp8_reference as ref  # noqa: E402
from infer.kernels import layers as triton_layers  # noqa: E402

# float16 where a result is compared with torch's own arithmetic: the interpreter rounds bfloat16 toward zero
# (its bfloat16 rows are checked against the 16-bit Triton kernels, which round alike)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def assert_same_bits(got, expected):
    (q, scale), (exp_q, exp_scale) = got, expected
    assert q.dtype == ref.FP8 and scale.dtype == torch.float32 and scale.shape == (q.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), exp_q.view(torch.uint8))  # -0.0 and +0.0 told apart
    assert torch.equal(scale, exp_scale)


def rows(t, k, dtype, seed=0, huge=6e4, large=500):
    """[t, k] random rows, and where t allows: a row of zeros, one with a single huge value (all else
    tiny against it: subnormals, zeros, -0.0), one with negative values only, one of large values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * 3
    if t > 4:
        x[1] = 0.0
        x[2] *= 1e-3
        x[2, k // 3] = huge
        x[3] = -x[3].abs()
        x[4] *= large
    return x.to(dtype)


def assert_within_fp8(q, scale, x):
    """q * scale within e4m3's rounding of x: 2^-4 of |x| for normals, 2^-10 of the scale below them."""
    x, deq = x.double(), q.double() * scale.double()
    assert torch.all((deq - x).abs() <= x.abs() * 2**-4 + scale.double() * 2**-10)


def assert_like_torch(got, expected, dtype):
    """A fused quantizer against its torch reference, which computes the 16-bit row with torch's own
    arithmetic: in float16 the same bits; in float32, whose row is not rounded to 16 bits, a scale
    within an ulp or two and values within one e4m3 step. (bfloat16: the interpreter rounds it toward
    zero, torch to nearest; tests/gpu takes it.)"""
    if dtype == torch.float16:
        assert_same_bits(got, expected)
    elif dtype == torch.float32:
        (q, scale), (exp_q, exp_scale) = got, expected
        torch.testing.assert_close(scale, exp_scale, rtol=3e-7, atol=0)
        deq, exp_deq = q.double() * scale, exp_q.double() * exp_scale
        assert torch.all((deq - exp_deq).abs() <= exp_deq.abs() * 2**-3 + exp_scale * 2**-9)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k", [(1, 100), (37, 100), (37, 64), (6, 1)])
def test_quantize_rows_matches_reference(dtype, t, k):
    x = rows(t, k, dtype)
    q, scale = fp8.quantize_rows(x)
    assert_same_bits((q, scale), ref.quantize_rows_reference(x))
    assert_within_fp8(q, scale, x)
    amax = x.float().abs().amax(-1)
    # each row's largest value lands on 448 (its product with the reciprocal may pass 448 by an ulp:
    # clamped); a row of zeros keeps zeros and the smallest scale
    assert torch.equal(q.float().abs().amax(-1), torch.where(amax > 0, 448.0, 0.0))
    torch.testing.assert_close(scale[amax == 0], torch.full_like(scale[amax == 0], ref.SCALE_MIN / 448))
    if t > 4 and k > 1:  # tiny negatives beside the huge value are stored as -0.0, as torch stores them
        assert (q[2].view(torch.uint8) == 0x80).any()


def test_quantizers_take_no_rows():
    empty = torch.empty(0, 32, dtype=torch.float16)
    for q, scale in (
        fp8.quantize_rows(empty),
        fp8.rms_norm_fp8(empty, torch.ones(32, dtype=torch.float16), 1e-5),
        fp8.silu_and_mul_fp8(empty),
    ):
        assert q.shape[0] == 0 and scale.shape == (0, 1)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_rms_norm_then_quantize_rows(dtype, t, with_residual):
    n, eps = 100, 1e-5
    gen = torch.Generator().manual_seed(1)
    x, residual = rows(t, n, dtype), torch.randn(t, n, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(n, generator=gen).to(dtype)
    got = fp8.rms_norm_fp8(x, weight, eps, residual)
    normed = triton_layers.rms_norm(x, weight, eps, residual)
    if with_residual:
        (got, res_out), (normed, exp_res) = got, normed
        assert torch.equal(res_out, exp_res)
    assert_same_bits(got, ref.quantize_rows_reference(normed))
    eager = ref.rms_norm_fp8_reference(x, weight, eps, residual)
    assert_like_torch(got, eager[0] if with_residual else eager, dtype)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of a very negative gate: -0.0
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 100), (37, 100), (37, 64)])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_fp8_is_act_and_mul_then_quantize_rows(dtype, t, i, gelu):
    h = rows(t, 2 * i, dtype, huge=300, large=10)  # act(gate) * up within float16
    got = (fp8.gelu_and_mul_fp8 if gelu else fp8.silu_and_mul_fp8)(h)
    y = (triton_layers.gelu_and_mul if gelu else triton_layers.silu_and_mul)(h)
    assert_same_bits(got, ref.quantize_rows_reference(y))
    assert_within_fp8(*got, y)
    if not gelu:
        assert_like_torch(got, ref.silu_and_mul_fp8_reference(h), dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_on_the_cpu_is_the_dequantized_product(out_dtype, with_bias):
    t, k, n = 37, 100, 24
    gen = torch.Generator().manual_seed(0)
    q, x_scale = ref.quantize_rows_reference(torch.randn(t, k, generator=gen))
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10
    w_q, w_scale = ref.quantize_rows_reference(w)
    w_scale = w_scale.view(n)
    bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
    got = fp8.scaled_mm(q, x_scale, w_q, w_scale, out_dtype, bias)
    assert got.dtype == out_dtype and got.shape == (t, n)
    a, b = q.double() * x_scale.double(), w_q.double() * w_scale.double()[:, None]
    expected = a @ b.T + (bias.double() if with_bias else 0.0)
    # float32 accumulation: within K * 2^-24 of sum |a||b|; then one rounding to out_dtype
    bound = k * 2**-24 * (a.abs() @ b.abs().T) + torch.finfo(out_dtype).eps * expected.abs()
    assert torch.all((got.double() - expected).abs() <= bound)


def test_scaled_mm_takes_its_bias_in_the_output_dtype():
    q, x_scale = ref.quantize_rows_reference(torch.randn(3, 32))
    w_q, w_scale = ref.quantize_rows_reference(torch.randn(16, 32))
    with pytest.raises(ValueError, match="output dtype torch.bfloat16, not torch.float32"):
        fp8.scaled_mm(q, x_scale, w_q, w_scale.view(16), torch.bfloat16, torch.zeros(16))
