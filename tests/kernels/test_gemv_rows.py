"""The GEMV over 1 to GEMV_MAX_ROWS rows of x (small batches, speculative decoding's verify step),
with bf16, fp16 and e4m3 weights, in Triton's interpreter, against the dequantized reference;
tolerances as in test_gemv_fp8 (fp32 summation order only). Each row count runs with the FMA tile
and with an MMA (tensor-core) one; the latter with fp16 x only, as the interpreter's bf16 dot is
wrong (tests/gpu/test_gemv_gpu.py takes bf16 on a GPU)."""

import pytest
import torch

triton_gemv = pytest.importorskip("infer.kernels.gemv")
from gemv_one_row import one_row_gemv  # noqa: E402  (tests/kernels, on sys.path)
from test_gemv_fp8 import assert_close, quantize_rows, reference  # noqa: E402

from infer.distributed.all_reduce.lamport import PushTarget  # noqa: E402
from infer.kernels import layers as triton_layers  # noqa: E402
from infer.plugins.layer import torch_layers as plain  # noqa: E402

ROWS = list(range(1, triton_gemv.GEMV_MAX_ROWS + 1))
MMA_TILE = triton_gemv.Tile(16, 32, 1, mma=True)  # the smallest tl.dot takes
# (weights, tile): bf16 weights go with bf16 x, which the interpreter's dot gets wrong
KINDS = [("bfloat16", "fma"), ("float16", "fma"), ("fp8", "fma"), ("float16", "mma"), ("fp8", "mma")]


def take_tile(name: str, monkeypatch) -> None:
    """The calls take the FMA tile (the interpreter's) or an MMA one in its place."""
    if name == "mma":
        monkeypatch.setattr(triton_gemv, "INTERPRETER_TILE", MMA_TILE)


def weights(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """A weight [N, K] of `kind`, its scale (e4m3 only), and the activations' dtype that goes with it."""
    w = torch.randn(n, k) / k**0.5
    if kind == "fp8":
        return (*quantize_rows(w), torch.float16)
    dtype = getattr(torch, kind)
    return w.to(dtype), None, dtype


def dequantized(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (w, scale) if scale is not None else (w, torch.ones(w.shape[0]))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind,tile", KINDS)
@pytest.mark.parametrize("n,k", [(13, 70), (16, 64)])  # masked tails in n and k; whole tiles
def test_every_row_is_its_product_with_the_weight(rows, kind, tile, n, k, monkeypatch):
    take_tile(tile, monkeypatch)
    torch.manual_seed(rows)
    w, scale, dtype = weights(kind, n, k)
    x = torch.randn(rows, k, dtype=dtype)
    got = triton_gemv.gemv(x, w, scale=scale)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close(got, reference(x, *dequantized(w, scale)))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("kind,tile", KINDS[1:])
def test_the_gated_form_reads_silu_and_mul_of_every_row(rows, kind, tile, monkeypatch):
    take_tile(tile, monkeypatch)
    torch.manual_seed(10 + rows)
    n, k = 13, 70
    w, scale, dtype = weights(kind, n, k)  # fp16 activations: the interpreter multiplies bf16 wrongly
    h = torch.randn(rows, 2 * k, dtype=dtype)
    got = triton_gemv.gemv_silu_mul(h, w, scale=scale)
    assert torch.equal(got, triton_gemv.gemv(triton_layers.silu_and_mul(h), w, scale=scale))
    assert_close(got, reference(plain.SiluAndMul()(h), *dequantized(w, scale)))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_gives_the_one_row_kernels_bits(gated, dtype):
    torch.manual_seed(3)
    n, k = 13, 70
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    x = torch.randn(1, 2 * k if gated else k, dtype=dtype)
    got = (triton_gemv.gemv_silu_mul if gated else triton_gemv.gemv)(x, w)
    expected = one_row_gemv(x, w, triton_gemv.INTERPRETER_TILE, gated)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_rows_beyond_the_limit_and_pushed_rows_are_refused():
    w = torch.randn(8, 32, dtype=torch.float16)
    limit = triton_gemv.GEMV_MAX_ROWS
    for rows in (0, limit + 1):
        with pytest.raises(AssertionError, match=f"takes 1 to {limit} rows"):
            triton_gemv.gemv(torch.randn(rows, 32, dtype=torch.float16), w)
    with pytest.raises(AssertionError, match=f"takes 1 to {limit} rows"):
        triton_gemv.gemv_silu_mul(torch.randn(limit + 1, 64, dtype=torch.float16), w)
    slot = torch.zeros(1, 8, dtype=torch.float16)
    target = PushTarget(torch.tensor([slot.data_ptr()]), 0, slot)
    with pytest.raises(AssertionError, match="one row's, got 2 rows"):
        triton_gemv.gemv(torch.randn(2, 32, dtype=torch.float16), w, push=target)
