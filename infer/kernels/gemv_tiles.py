"""The GEMV's launch shapes (`Tile`), the candidates tried for a weight, and the tuner that times them
the way a decode step runs them (see `infer.kernels.gemv`'s docstring)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton

from infer.kernels import gemv_e4m3


class Tile(NamedTuple):
    """How a call is launched: BLOCK_N rows of W a program, BLOCK_K columns a step, its warps and
    software-pipeline stages, and `mma`: the rows of x meet the weight tile on tensor cores (tl.dot,
    x padded to 16 rows; several rows of bf16 or fp16 x) rather than in fp32 FMAs; `f16_sums`: one row of
    e4m3 x against e4m3 weights, the products summed in f16 pairs (`infer.kernels.gemv_e4m3`)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    mma: bool = False
    f16_sums: bool = False


# (BLOCK_N, BLOCK_K, num_warps): few rows and long, coalesced rows of 16-byte loads win at one token;
# the small tiles serve narrow models (K of a few hundred)
CANDIDATES = [
    Tile(*t)
    for t in [(1, 512, 1), (1, 512, 2), (1, 1024, 4), (1, 4096, 4), (2, 512, 2), (2, 1024, 4), (2, 2048, 8)]
    + [(4, 1024, 4), (4, 256, 2), (8, 256, 4), (8, 128, 2), (16, 128, 4)]
]
# an e4m3 row is half a bf16 row's bytes (16 weights a 16-byte load): the same loads in flight take
# twice the columns, so 1-byte weights also try these
FP8_CANDIDATES = [
    Tile(*t) for t in [(1, 1024, 1), (1, 1024, 2), (1, 2048, 4), (1, 8192, 4), (2, 2048, 4), (2, 4096, 8), (4, 2048, 8)]
]
# several rows also try tensor cores, weight tiles pipelined through shared memory
MMA_CANDIDATES = [Tile(n, k, 4, 3, mma=True) for n, k in [(16, 512), (32, 256), (32, 512), (64, 128), (64, 256)]]
# one e4m3 row against e4m3 weights also tries the f16-pair kernel (where `gemv_e4m3.fits`); the last
# three won at one of Llama-3-8B's four shapes each in a wider sweep (docs/performance.md, "FP8")
F16_SUMS_CANDIDATES = [
    Tile(n, k, w, s, f16_sums=True)
    for n, k, w, s in [(1, 2048, 4, 1), (1, 4096, 4, 1), (2, 1024, 4, 1), (2, 2048, 4, 1), (2, 4096, 8, 1)]
    + [(4, 1024, 4, 1), (4, 2048, 8, 1), (2, 2048, 2, 1), (2, 2048, 4, 2), (4, 2048, 4, 1)]
]
INTERPRETER_TILE = Tile(4, 32, 1)


def candidates(x: torch.Tensor, weight: torch.Tensor) -> list[Tile]:
    fp8 = FP8_CANDIDATES if weight.element_size() == 1 else []
    mma = MMA_CANDIDATES if x.shape[0] > 1 and x.dtype in (torch.bfloat16, torch.float16) else []
    f16_sums = F16_SUMS_CANDIDATES if gemv_e4m3.fits(x, weight) else []
    return CANDIDATES + fp8 + mma + f16_sums


def tune(tiles: list[Tile], weight: torch.Tensor, run: Callable[[Tile, torch.Tensor], None]) -> Tile:
    """The tile with the least device time per call of `run(tile, weight)`, calls captured back to back
    in a graph over weights that do not fit in L2 (copies of `weight`'s shape when it would)."""
    from infer.kernels.timing import captured_seconds

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gemv: the first call for a weight shape tunes its tile and must run before graph capture")
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    if weight.nbytes >= 2 * l2:  # streams from memory at every call as it is
        weights = [weight]
    else:  # copies enough to overflow L2 (their values do not matter to the time)
        weights = list(
            torch.empty((-(-3 * l2 // weight.nbytes), *weight.shape), dtype=weight.dtype, device=weight.device)
        )
    times = {}
    for tile in tiles:
        try:
            times[tile] = captured_seconds(
                lambda i: run(tile, weights[i % len(weights)]), calls=max(8, 2 * len(weights)), replays=3
            )
        except triton.runtime.errors.OutOfResources:  # a tile this GPU cannot hold
            continue
    return min(times, key=times.get)
