"""The W4A16 GEMV (issue 47) against x @ dequantized(W).T, in Triton's interpreter on the CPU (tests/conftest.py
sets TRITON_INTERPRET without CUDA) or on a GPU: group sizes 32, 64, 128 and one a row, symmetric and not,
act-order, bias, 1 to 8 rows."""

from __future__ import annotations

import pytest
import torch

from infer.testing.int4_layers import dequantized_product as _reference
from infer.testing.int4_layers import random_int4_layer as _layer


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    "group, symmetric, act_order",
    [
        (32, True, False),
        (64, False, False),
        (128, True, False),
        (-1, False, False),
        (32, False, True),
        (128, True, True),
    ],
)
def test_int4_gemv_equals_the_dequantized_product(rows, group, symmetric, act_order):
    from infer.kernels.int4_gemv import int4_gemv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = 48, 256
    (qweight, s, z, g_idx), width = _layer(n, k, group, symmetric, act_order, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device)
    bias = torch.randn(n).to(device) if rows == 3 else None
    y = int4_gemv(x, qweight, s, z, g_idx, width, act_order, bias)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.float(), _reference(x, qweight, s, z, g_idx, bias), rtol=1e-4, atol=1e-4)


def test_int4_gemv_in_bf16_rounds_once():
    from infer.kernels.int4_gemv import int4_gemv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (qweight, s, z, g_idx), width = _layer(40, 128, 64, True, False, device, seed=3)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    y = int4_gemv(x, qweight, s, z, g_idx, width, False)
    assert y.dtype == torch.bfloat16
    expected = _reference(x, qweight, s, z, g_idx, None).to(torch.bfloat16)
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)


def test_int4_gemv_refuses_what_it_does_not_take():
    from infer.kernels.int4_gemv import INT4_GEMV_MAX_ROWS, int4_gemv
    from infer.plugins.layer.int4 import GPU_GEMV_ROWS

    assert GPU_GEMV_ROWS == INT4_GEMV_MAX_ROWS  # the layer sends the kernel no more rows than it takes
    (qweight, s, z, g_idx), width = _layer(16, 64, 32, True, False, "cpu")
    with pytest.raises(ValueError, match="1 to 8 rows"):
        int4_gemv(torch.zeros(INT4_GEMV_MAX_ROWS + 1, 64), qweight, s, z, g_idx, width, False)
    with pytest.raises(ValueError, match="x has 32 columns"):
        int4_gemv(torch.zeros(1, 32), qweight, s, z, g_idx, width, False)
