"""The GEMV's public pieces for tile sweeps (`infer.bench.gemv_sweep`): one launch with a given tile,
and the table of tiles tuned so far."""

import pytest
import torch

triton_gemv = pytest.importorskip("infer.kernels.gemv")


def test_run_tile_is_gemv_with_the_tile_given():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU through Triton's interpreter
    torch.manual_seed(0)
    x = torch.randn(1, 64, device=device)
    w = torch.randn(8, 64, device=device)
    y = torch.empty(1, 8, device=device)
    triton_gemv.run_tile(x, w, y, (4, 32, 1))
    torch.testing.assert_close(y, triton_gemv.gemv(x, w))
    tiles = triton_gemv.tuned_tiles()
    tiles[("not", "a", "shape")] = (1, 1, 1)  # a copy: the tuner's own table is not changed
    assert ("not", "a", "shape") not in triton_gemv.tuned_tiles()
