"""The GEMV compiled on a GPU at Llama-3-8B's weight shapes: e4m3 weights over 1 to 8 rows of x
against the dequantized reference x.float() @ (w.float() * scale[:, None]).T rounded to bf16, one
e4m3 row summed in f16 pairs against the float64 product of its e4m3 values, bf16 weights over
several rows, and one bf16 row with the bits of the one-row kernel it grew from.
Run: `pytest -m gpu tests/gpu/test_gemv_gpu.py`."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 interprets the kernels"),
]
pytest.importorskip("triton")
needs_e4m3 = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="e4m3 needs sm_89+"
)

QKV, O, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)  # (N, K)
ROWS = (1, 2, 4, 8)
BF16_ULP = 2**-7


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as e4m3 [N, K] and a float32 scale [N]: each row's largest |w| becomes e4m3's 448."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 448.0
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ (w.float() * scale[:, None]).T).to(x.dtype)


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """got against `reference`. The two fp32 sums differ in their order (and where the scale
    multiplies; on tensor cores, whose fp32 accumulation does not round each add as IEEE does, in
    more): by a small multiple of fp32's eps (2^-23) times the sum of |terms|. That moves the
    rounding to bf16 by one ulp at most (rtol), or a result near zero by that much (atol, 8 eps)."""
    scale = torch.ones(w.shape[0], device=w.device) if scale is None else scale
    magnitude = (x.float().abs() @ (w.float().abs() * scale[:, None]).T).max().item()
    torch.testing.assert_close(got, reference(x, w, scale), atol=2**-20 * magnitude, rtol=BF16_ULP)


def one_row_gemv():
    """tests/kernels/gemv_one_row.py: the one-row kernel before several rows and FP8 weights."""
    path = Path(__file__).resolve().parents[1] / "kernels" / "gemv_one_row.py"
    spec = importlib.util.spec_from_file_location("gemv_one_row", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.one_row_gemv


@needs_e4m3
@pytest.mark.parametrize("n,k", [QKV, GATE_UP])
def test_fp8_rows_are_the_dequantized_product(n, k):
    from infer.kernels import gemv as triton_gemv
    from infer.kernels import gemv_tiles

    torch.manual_seed(0)
    w8, scale = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert_close(triton_gemv.gemv(x, w8, scale=scale), x, w8, scale)
    for rows in ROWS:  # a tile tuned for each row count, among the candidates for 1-byte weights
        tile = triton_gemv.tuned_tiles()[(n, k, torch.float8_e4m3fn, torch.bfloat16, w8.device, rows)]
        mma = gemv_tiles.MMA_CANDIDATES if rows > 1 else []
        assert tile in gemv_tiles.CANDIDATES + gemv_tiles.FP8_CANDIDATES + mma


@needs_e4m3
def test_fp8_down_projection_reads_silu_and_mul_inside():
    from infer.kernels import gemv as triton_gemv
    from infer.kernels import layers as tl_layers

    n, k = DOWN
    torch.manual_seed(1)
    w8, scale = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
    for rows in ROWS:
        h = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
        act = tl_layers.silu_and_mul(h)
        got = triton_gemv.gemv_silu_mul(h, w8, scale=scale)
        assert torch.equal(got, triton_gemv.gemv(act, w8, scale=scale))
        assert_close(got, act, w8, scale)


def e4m3_row_operands(n: int, k: int, outlier: bool):
    """e4m3 weights [N, K] with their scales and one e4m3 row of x with its scale, as the FP8 layers hold
    them; `outlier`: a weight column 50x the others meeting an activation of 400, so that most rows'
    largest product is e4m3's 448 x 448."""
    from infer.kernels.fp8 import quantize_rows as quantize_activation

    torch.manual_seed(5)
    w = torch.randn(n, k, device="cuda") / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if outlier:
        w[:, 7] *= 50
        x[0, 7] = 400.0
    w8, scale = quantize_rows(w)
    q, x_scale = quantize_activation(x)
    if outlier:
        assert q[0, 7].float().abs() == 448 and (w8[:, 7].float().abs() == 448).float().mean() > 0.9
    return w8, scale, q, x_scale


def e4m3_row_error(y: torch.Tensor, w8, scale, q, x_scale) -> torch.Tensor:
    """Each output's distance from the float64 sum of its e4m3 terms, over the sum of their |terms|."""
    dequantized = w8.double() * scale.double()[:, None]
    exact = (dequantized @ (q.double() * x_scale.double()).T)[:, 0]
    magnitude = (dequantized.abs() @ (q.double().abs() * x_scale.double()).T)[:, 0]
    return (y[0].double() - exact).abs() / magnitude


@needs_e4m3
@pytest.mark.parametrize("n,k", [QKV, O, GATE_UP, DOWN, (1000, 4112)])
def test_one_e4m3_row_with_f16_sums_is_the_product_of_its_e4m3_values(n, k):
    """Each f16_sums tile (`infer.kernels.gemv_e4m3`), with an fp32 output, against the float64 sum of
    the same e4m3 values (K 4112 takes the masked tail, N 1000 a partial last program). On Gaussian rows
    every error stays under 2^-13 of the row's sum of |terms| and the median under 2^-15 (the same f16
    roundings emulated in float64 on a CPU: at most 2^-14.9, median 2^-17.5; one group of 16 products
    dropped: median 2^-12 or more, a pair of x's words swapped: far more). Where an outlier weight
    meets an outlier activation (products at e4m3's 448 x 448: nothing overflows) one product
    dominates each row and its half-group's f16 roundings with it: at most 2^-8 (7 roundings of 2^-11,
    and products below f16's normal range), median under 2^-12 (emulated 2^-13.2 to 2^-14.4)."""
    from infer.kernels import gemv as triton_gemv
    from infer.kernels import gemv_tiles

    for outlier, worst, median in ((False, 2**-13, 2**-15), (True, 2**-8, 2**-12)):
        w8, scale, q, x_scale = e4m3_row_operands(n, k, outlier)
        for tile in gemv_tiles.F16_SUMS_CANDIDATES:
            y = torch.empty(1, n, device="cuda")
            triton_gemv.run_tile(q, w8, y, tile, scale=scale, x_scale=x_scale)
            assert torch.isfinite(y).all(), tile
            error = e4m3_row_error(y, w8, scale, q, x_scale)
            assert error.max() <= worst, (outlier, tile, error.max().item())
            assert error.median() <= median, (outlier, tile, error.median().item())


@needs_e4m3
def test_one_e4m3_row_with_f16_sums_through_gemv_any_layout_and_pdl():
    """The f16-pair kernel as the engine calls it: through `gemv` on its tuned tile (whichever kernel
    won, the bits of that tile's launch), a bf16 output that is the fp32 one rounded, the same bits
    under PDL and from a weight whose rows lie further apart than K; and an x off an 8-byte boundary,
    which that kernel cannot read, goes to the FMA kernel at the same tile shape (no fault, the product)."""
    from infer.kernels import gemv as triton_gemv
    from infer.kernels import gemv_tiles

    n, k = QKV
    w8, scale, q, x_scale = e4m3_row_operands(n, k, outlier=False)
    got = triton_gemv.gemv(q, w8, scale=scale, x_scale=x_scale, out_dtype=torch.float32)
    tile = triton_gemv.tuned_tiles()[(n, k, w8.dtype, q.dtype, w8.device, 1)]
    y = torch.empty(1, n, device="cuda")
    triton_gemv.run_tile(q, w8, y, tile, scale=scale, x_scale=x_scale)
    assert torch.equal(got, y)
    tile = gemv_tiles.F16_SUMS_CANDIDATES[3]  # (2, 2048, 4): the f16-pair kernel from here on
    triton_gemv.run_tile(q, w8, y, tile, scale=scale, x_scale=x_scale)
    y16 = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for pdl in (False, True):
        triton_gemv.run_tile(q, w8, y16, tile, scale=scale, x_scale=x_scale, pdl=pdl)
        assert torch.equal(y16, y.bfloat16()), pdl
    wide = torch.zeros(n, k + 16, device="cuda", dtype=w8.dtype)
    wide[:, :k] = w8
    strided = torch.empty_like(y)
    triton_gemv.run_tile(q, wide[:, :k], strided, tile, scale=scale, x_scale=x_scale)
    assert torch.equal(strided, y)
    off = torch.zeros(1, k + 8, device="cuda", dtype=q.dtype)[:, 1 : k + 1]
    off.copy_(q)
    assert off.data_ptr() % 8 == 1
    fallback = torch.empty_like(y)
    triton_gemv.run_tile(off, w8, fallback, tile, scale=scale, x_scale=x_scale)
    assert e4m3_row_error(fallback, w8, scale, q, x_scale).max() <= 2**-13


@needs_e4m3
def test_the_tuner_offers_f16_sums_to_one_e4m3_row_only():
    """One e4m3 row against e4m3 weights may be tuned to an f16_sums tile; a bf16 row, or two e4m3
    rows, never are (that kernel takes neither)."""
    from infer.kernels import gemv_tiles
    from infer.kernels.fp8 import quantize_rows as quantize_activation

    w8, _ = quantize_rows(torch.randn(*QKV, device="cuda"))
    one, _ = quantize_activation(torch.randn(1, QKV[1], device="cuda", dtype=torch.bfloat16))
    two, _ = quantize_activation(torch.randn(2, QKV[1], device="cuda", dtype=torch.bfloat16))
    bf16 = torch.randn(1, QKV[1], device="cuda", dtype=torch.bfloat16)
    assert set(gemv_tiles.F16_SUMS_CANDIDATES) <= set(gemv_tiles.candidates(one, w8))
    for x in (two, bf16):
        assert not any(t.f16_sums for t in gemv_tiles.candidates(x, w8))


@pytest.mark.parametrize("n,k", [QKV, DOWN])
def test_bf16_rows_are_the_product(n, k):
    from infer.kernels.gemv import gemv

    torch.manual_seed(2)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for rows in (2, 5, 8):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert_close(gemv(x, w), x, w)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("kind", ["bf16", pytest.param("fp8", marks=needs_e4m3)])
def test_rows_on_either_kernel(kind, mma):
    """Several rows on tensor cores and in FMAs, whichever the tuner picks at these shapes."""
    from infer.kernels import gemv as triton_gemv

    n, k = QKV
    torch.manual_seed(4)
    w = torch.randn(n, k, device="cuda") / k**0.5
    w, scale = quantize_rows(w) if kind == "fp8" else (w.to(torch.bfloat16), None)
    tile = triton_gemv.Tile(64, 256, 4, 3, mma=True) if mma else triton_gemv.Tile(2, 1024, 4)
    for rows in (2, 5, 8):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        triton_gemv.run_tile(x, w, y, tile, scale=scale)
        assert_close(y, x, w, scale)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n,k", [QKV, DOWN])
def test_one_bf16_row_gives_the_one_row_kernels_bits(n, k, gated):
    from infer.kernels import gemv as triton_gemv

    torch.manual_seed(3)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    got = (triton_gemv.gemv_silu_mul if gated else triton_gemv.gemv)(x, w)
    tile = triton_gemv.tuned_tiles()[(n, k, w.dtype, x.dtype, w.device, 1)]
    assert torch.equal(got.view(torch.int16), one_row_gemv()(x, w, tile, gated).view(torch.int16))
