"""The FP8 activation kernels (`infer.kernels.fp8`) compiled, at Llama-3-8B's shapes: each quantizer
gives the bits of `quantize_rows_reference` over the matching 16-bit kernel (and is within one e4m3
step of its torch reference), and torch._scaled_mm is the float64 product of the dequantized
operands within the error its accumulation and output rounding allow.
Figures behind the bounds: docs/performance.md, "FP8 activations (W8A8)"."""

import pytest
import torch

pytestmark = pytest.mark.gpu

TOKENS = [1, 16, 512, 4096]
HIDDEN, INTERMEDIATE = 4096, 14336
PROJECTIONS = {"qkv": (4096, 6144), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


@pytest.fixture(autouse=True)
def fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matrix products need compute capability 8.9 or newer")


def assert_same_bits(got, expected):
    (q, scale), (exp_q, exp_scale) = got, expected
    assert torch.equal(q.view(torch.uint8), exp_q.view(torch.uint8))
    assert torch.equal(scale, exp_scale)


def assert_within_one_step(got, expected):
    """The fused quantizer against its torch reference, whose 16-bit row may differ in the last bit
    (Triton's exp and rsqrt against torch's): the scales within that bit, values within one e4m3 step."""
    (q, scale), (exp_q, exp_scale) = got, expected
    torch.testing.assert_close(scale, exp_scale, rtol=2**-7, atol=0)
    deq, exp_deq = q.double() * scale, exp_q.double() * exp_scale
    assert torch.all((deq - exp_deq).abs() <= exp_deq.abs() * 2**-3 + exp_scale * 2**-8)


def activations(t, k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=gen)
    x[0, 7] = 300.0  # an outlier: the rest of its row lands far below 448, its smallest values in subnormals
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", TOKENS)
def test_quantize_rows_matches_reference(dtype, t):
    from infer.kernels import fp8
    from infer.kernels.fp8_reference import quantize_rows_reference

    for k in (HIDDEN, INTERMEDIATE):
        x = activations(t, k, dtype)
        assert_same_bits(fp8.quantize_rows(x), quantize_rows_reference(x))


def test_the_compiled_cast_rounds_as_torch_near_every_e4m3_value():
    """Compiled, the quantizers leave the rounding to the cast (the interpreter rounds in float32 first):
    in a row whose amax is 448 (scale ~1), every e4m3 value, the midpoints between neighbours and the
    floats either side of each, of both signs (ties to even, subnormals, -0.0), give torch's bits."""
    from infer.kernels import fp8
    from infer.kernels.fp8_reference import quantize_rows_reference

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    row = torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([-1e-30, 1e-30, -0.0])])
    x = row.view(1, -1).cuda()
    for warps_row in (x, x.expand(fp8.FEW_ROWS, -1)):  # one program's warps for a row both ways (`_warps`)
        assert_same_bits(fp8.quantize_rows(warps_row), quantize_rows_reference(warps_row))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_rms_norm_then_quantize_rows(dtype, t, with_residual):
    from infer.kernels import fp8
    from infer.kernels import layers as triton_layers
    from infer.kernels.fp8_reference import quantize_rows_reference, rms_norm_fp8_reference

    x = activations(t, HIDDEN, dtype)
    residual = activations(t, HIDDEN, dtype, seed=1) if with_residual else None
    weight = (torch.rand(HIDDEN, device="cuda") + 0.5).to(dtype)
    got = fp8.rms_norm_fp8(x, weight, 1e-5, residual)
    normed = triton_layers.rms_norm(x, weight, 1e-5, residual)
    eager = rms_norm_fp8_reference(x, weight, 1e-5, residual)
    if with_residual:
        (got, res_out), (normed, exp_res), eager = got, normed, eager[0]
        assert torch.equal(res_out, exp_res)
    assert_same_bits(got, quantize_rows_reference(normed))
    assert_within_one_step(got, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", TOKENS)
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_rows(dtype, t):
    from infer.kernels import fp8
    from infer.kernels import layers as triton_layers
    from infer.kernels.fp8_reference import quantize_rows_reference, silu_and_mul_fp8_reference

    h = activations(t, 2 * INTERMEDIATE, dtype)
    got = fp8.silu_and_mul_fp8(h)
    assert_same_bits(got, quantize_rows_reference(triton_layers.silu_and_mul(h)))
    assert_within_one_step(got, silu_and_mul_fp8_reference(h))


def fp8_operands(t, k, n):
    """An activation and a weight quantized as an FP8 linear layer holds them: a scale per token, one
    per output channel (channels of different magnitudes)."""
    from infer.kernels.fp8_reference import quantize_rows_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * (torch.rand(n, 1, device="cuda", generator=gen) + 0.1)
    q, x_scale = quantize_rows_reference(x)
    w_q, w_scale = quantize_rows_reference(w / k**0.5)
    return q, x_scale, w_q, w_scale.view(n)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_scaled_mm_is_the_dequantized_product(t, projection):
    from infer.kernels import fp8

    k, n = PROJECTIONS[projection]
    q, x_scale, w_q, w_scale = fp8_operands(t, k, n)
    a, b = q.double() * x_scale.double(), w_q.double() * w_scale.double()[:, None]  # exact
    expected = a @ b.T
    # accumulation: within 2^-14 of sum |a||b| (Hopper's FP8 tensor cores keep fewer bits than float32 in
    # their partial sums: seen on an H100, 2.3e-5 = 2^-15.4 at most, 1.3e-4 of the product's norm in a
    # float32 output), then one rounding to out_dtype (its eps of |y|)
    slack = 2**-14 * (a.abs() @ b.abs().T)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        bias = torch.randn(n, device="cuda").to(out_dtype)
        for out_bias in (None, bias):
            got = fp8.scaled_mm(q, x_scale, w_q, w_scale, out_dtype, out_bias).double()
            want = expected if out_bias is None else expected + bias.double()
            assert got.shape == (t, n)
            assert torch.all((got - want).abs() <= torch.finfo(out_dtype).eps * want.abs() + slack)
        # as a norm: within the output's rounding (bfloat16: 1.7e-3 seen), float32's within 2^-11
        assert (got - want).norm() <= max(torch.finfo(out_dtype).eps / 2, 2**-11) * want.norm()


def test_scaled_mm_refuses_shapes_torch_cannot_take():
    from infer.kernels import fp8

    q, x_scale, w_q, w_scale = fp8_operands(4, 4096, 40)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.scaled_mm(q, x_scale, w_q, w_scale, torch.bfloat16)
