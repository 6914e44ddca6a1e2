"""The GEMV's public pieces for tile sweeps (`benchmarks.lab.gemv_sweep`): one launch with a given tile,
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


def test_f16_sums_tiles_are_offered_only_where_their_kernel_runs():
    """The f16-pair kernel is PTX: never on a CPU (or under the interpreter), never for operands it
    cannot take (checked again at every launch): one e4m3 row, 8 values a word."""
    from infer.kernels import gemv_e4m3, gemv_tiles

    e4m3 = torch.float8_e4m3fn
    x, w = torch.zeros(1, 64).to(e4m3), torch.zeros(8, 64).to(e4m3)
    assert gemv_e4m3.takes(x, w) and not gemv_e4m3.fits(x, w)
    assert not any(tile.f16_sums for tile in gemv_tiles.candidates(x, w))
    assert not gemv_e4m3.takes(torch.zeros(1, 80).to(e4m3)[:, 1:65], w)  # x 1 byte off a word
    assert not gemv_e4m3.takes(x[:, :40], w[:, :40])  # K 40: not a multiple of 16
    assert not gemv_e4m3.takes(torch.zeros(2, 64).to(e4m3), w)  # two rows
    assert not gemv_e4m3.takes(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # a 16-bit x
