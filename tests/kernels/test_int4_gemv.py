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


@pytest.mark.parametrize("tile", [(2, 64, 4, 3), (4, 32, 2, 3), (1, 256, 4, 3)])  # steps of 128, 64, 512 columns
@pytest.mark.parametrize(
    "group, act_order", [(32, False), (64, False), (-1, False), (32, True)]
)  # steps over several groups (by index), within one, and act-order's g_idx
def test_each_tile_the_tuner_may_pick_gives_the_dequantized_product(tile, group, act_order):
    from infer.kernels.int4_gemv import Int4Tile, int4_gemv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (qweight, s, z, g_idx), width = _layer(40, 384, group, False, act_order, device, seed=7)
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(8)).to(device)
    y = int4_gemv(x, qweight, s, z, g_idx, width, act_order, tile=Int4Tile(*tile))
    torch.testing.assert_close(y.float(), _reference(x, qweight, s, z, g_idx, None), rtol=1e-4, atol=1e-4)


def test_the_tuner_keeps_the_fixed_tile_among_its_candidates_and_tunes_only_while_warming_up():
    from infer.kernels import int4_gemv as module

    for rows in (1, 2, 4, 8):
        tiles = module.candidates(rows, 128)
        assert tiles[0] == module.default_tile(rows, 128)
        assert all(triton_rows(rows) * t.block_n * 2 * t.block_j <= 8192 for t in tiles[1:])  # the others fit
    (qweight, s, z, g_idx), width = _layer(16, 64, 32, True, False, "cpu")
    x = torch.randn(1, 64)
    assert module._tile(x, qweight, s, z, g_idx, width, False, None) == module.default_tile(1, width)
    assert (
        module.tuned_tiles() == {}
    )  # not warming up (and interpreted): nothing tuned, nothing compiled but the default


def triton_rows(rows: int) -> int:
    return 1 << (rows - 1).bit_length()
