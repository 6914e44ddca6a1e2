"""`infer.kernels.argmax` (on the CPU under Triton's interpreter, chunks made small so rows span many):
torch.argmax's indices, its order included: NaN above every number, the first index among equals,
-0.0 equal to 0.0. At a real vocabulary on a GPU: tests/gpu/test_argmax_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")
from infer.kernels import argmax  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(argmax, "CHUNK", 64)


def edge_rows(v: int) -> torch.Tensor:
    """[9, v] float32 rows: random; all -inf; NaNs in two chunks; the largest value twice, in two
    chunks; +inf twice; zeros beside a -0.0 ahead of them; all equal; the largest in the last column;
    NaN in the last column beside +inf."""
    x = torch.randn(9, v, generator=torch.Generator().manual_seed(v))
    x[1] = -INF
    x[2, 5], x[2, v - 50] = NAN, NAN
    x[3, 100], x[3, v - 100] = 1e9, 1e9
    x[4, 70], x[4, 10] = INF, INF
    x[5] = -1.0
    x[5, 3], x[5, 3 + 64] = -0.0, 0.0  # equal: the first wins, whichever sign
    x[6] = 2.5
    x[7, v - 1] = 1e9
    x[8, v - 1], x[8, 0] = NAN, INF
    return x


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("v", [300, 256, 129, 2100])  # 2,100: more chunks (33) than one warp's lanes
def test_argmax_rows_is_torch_argmax(v):
    x = edge_rows(v)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_rows_of_16_bit_rows(dtype):
    x = edge_rows(200).to(dtype)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_of_strided_short_and_empty_batches():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 400, generator=gen)
    for x in (wide[:, ::2], wide[:, :64], wide[:, :1], wide[:0]):
        got = argmax.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_takes_what_float32_holds_exactly():
    """float64 rows would lose their extra bits in the float32 comparisons: refused (the sampler then
    uses torch's), as are rows without columns."""
    assert argmax.takes(torch.zeros(2, 5)) and argmax.takes(torch.zeros(2, 5, dtype=torch.bfloat16))
    assert not argmax.takes(torch.zeros(2, 5, dtype=torch.float64))
    assert not argmax.takes(torch.zeros(2, 0))
    assert not argmax.takes(torch.zeros(5))
    with pytest.raises(AssertionError, match="float32/bfloat16/float16"):
        argmax.argmax_rows(torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64))
