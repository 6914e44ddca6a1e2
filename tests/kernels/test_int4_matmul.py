"""The W4A16 GEMM (issue 47: prefill chunks and decode batches past the GEMV's rows) against x @ dequantized(W).T,
in Triton's interpreter on the CPU or on a GPU: row counts over each tile choice, a row count and a width that
no tile divides, group sizes 32, 64, 128 and one a row, symmetric and not, act-order, bias, float32 and bf16."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
from infer.testing.int4_layers import dequantized_product as _reference  # noqa: E402
from infer.testing.int4_layers import random_int4_layer as _layer  # noqa: E402


@pytest.mark.parametrize("rows", [9, 37, 150])  # each of _config's tile choices; none a multiple of its tile
@pytest.mark.parametrize(
    "group, symmetric, act_order",
    [(32, True, False), (64, False, False), (128, True, True), (-1, False, False)],
)
def test_int4_matmul_equals_the_dequantized_product(rows, group, symmetric, act_order):
    from infer.kernels.int4_matmul import int4_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = 136, 256  # 136: a column of tiles runs past the weight's rows
    (qweight, s, z, g_idx), width = _layer(n, k, group, symmetric, act_order, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(device)
    bias = torch.randn(n).to(device) if rows == 37 else None
    y = int4_matmul(x, qweight, s, z, g_idx, width, act_order, bias)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, _reference(x, qweight, s, z, g_idx, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="Triton 3.9's interpreter multiplies bf16 tiles wrongly in tl.dot (a 16 x 16 product 1e10 off); on a GPU it runs",
)
def test_int4_matmul_in_bf16_rounds_the_weight_as_the_layer_does():
    """bf16: the weight's tile rounded to bf16 (as `Int4Linear.dequantized(bf16)`), float32 sums, y rounded once."""
    from infer.kernels.int4_matmul import int4_matmul
    from infer.kernels.int4_reference import unpack_nibbles

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (qweight, s, z, g_idx), width = _layer(64, 128, 64, False, False, device, seed=5)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
    y = int4_matmul(x, qweight, s, z, g_idx, width, False)
    cols = g_idx.long()
    w = ((unpack_nibbles(qweight).float() - z.float()[:, cols]) * s[:, cols]).to(torch.bfloat16)
    expected = (x.float() @ w.float().T).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)


def test_int4_matmul_takes_no_rows_and_refuses_a_width_that_does_not_fit():
    from infer.kernels.int4_matmul import int4_matmul

    (qweight, s, z, g_idx), width = _layer(16, 64, 32, True, False, "cpu")
    assert int4_matmul(torch.zeros(0, 64), qweight, s, z, g_idx, width, False).shape == (0, 16)
    with pytest.raises(ValueError, match="x has 32 columns"):
        int4_matmul(torch.zeros(3, 32), qweight, s, z, g_idx, width, False)
