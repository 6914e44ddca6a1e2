"""Matrix-vector product for one-token steps (batch-1 decode), in Triton.

At one token a linear layer is a pure weight stream: y[n] = sum_k W[n, k] x[k] reads every weight
once and does two FLOPs per weight, so its time is the weight bytes over the memory bandwidth and
the kernel's only job is to keep enough 16-byte loads in flight. Each program streams a few whole
rows of W (BLOCK_N rows, BLOCK_K columns per iteration: coalesced along k, as W is stored), keeps
the x chunk in registers and accumulates in fp32, reducing across k once at the end. The weights
are read once per step, so they are loaded evict-first to keep the activations in L2. Launched as a
programmatic dependent (`triton_pdl`), it loads its first weight tile before
waiting for the kernel that wrote x.

FP8 weights (torch.float8_e4m3fn, compute capability 8.9 or newer) stream half the bytes: each
weight is cast to fp32 as loaded, and each output row's sum is multiplied by its float32 scale in
the epilogue (y[n] = (sum_k w[n, k] x[k]) * scale[n], rounded once to x's dtype). The scales, like
the weights, are loaded before the wait.

Tile shapes (BLOCK_N, BLOCK_K, num_warps from CANDIDATES, and FP8_CANDIDATES for 1-byte weights)
are tuned once per (N, K, dtypes, device) at the first call for a shape, which must come before any
CUDA graph capture (the engine's warm-up makes it; inside a capture it raises): each candidate is
timed the way a decode step runs it, launched back to back in a CUDA graph over weights that do not
fit in L2 (copies of the weight's shape when it would), as programmatic dependents when those are
on. One tile per shape serves the plain, PDL and gated forms, so all give the same bits. Under
TRITON_INTERPRET=1 one small tile is used. Why not Triton's autotuner, and what was measured:
docs/performance.md, "Weight-streaming GEMV".
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer import env
from infer.kernels.layers import lamport_push
from infer.kernels.triton_pdl import kernel_args, wait_and_release

# (BLOCK_N, BLOCK_K, num_warps): few rows and long, coalesced rows of 16-byte loads win at one token;
# the small tiles serve narrow models (K of a few hundred)
CANDIDATES = [
    (1, 512, 1),
    (1, 512, 2),
    (1, 1024, 4),
    (1, 4096, 4),
    (2, 512, 2),
    (2, 1024, 4),
    (2, 2048, 8),
    (4, 1024, 4),
    (4, 256, 2),
    (8, 256, 4),
    (8, 128, 2),
    (16, 128, 4),
]
# an e4m3 row is half a bf16 row's bytes (16 weights a 16-byte load): the same loads in flight take
# twice the columns, so 1-byte weights also try these
FP8_CANDIDATES = [
    (1, 1024, 1),
    (1, 1024, 2),
    (1, 2048, 4),
    (1, 8192, 4),
    (2, 2048, 4),
    (2, 4096, 8),
    (4, 2048, 8),
]
INTERPRETER_TILE = (4, 32, 1)
# read once: the kernels below are interpreted or compiled as TRITON_INTERPRET was when they were
# decorated (at this import), and _tile runs at every launch
_INTERPRETED = env.triton_interpret()
_tiles: dict[tuple, tuple[int, int, int]] = {}


def _tile(
    x: torch.Tensor, weight: torch.Tensor, gated: bool, scale: torch.Tensor | None = None
) -> tuple[int, int, int]:
    if _INTERPRETED:
        return INTERPRETER_TILE
    key = (*weight.shape, weight.dtype, x.dtype, weight.device)
    if key not in _tiles:
        _tiles[key] = _tune(x, weight, gated, scale)
    return _tiles[key]


def _tune(x: torch.Tensor, weight: torch.Tensor, gated: bool, scale: torch.Tensor | None) -> tuple[int, int, int]:
    """The candidate with the least device time per call, calls captured back to back in a graph."""
    from infer.kernels.timing import captured_seconds

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gemv: the first call for a weight shape tunes its tile and must run before graph capture")
    n, k = weight.shape
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    if weight.nbytes >= 2 * l2:  # streams from memory at every call as it is
        weights = [weight]
    else:  # copies enough to overflow L2 (their values do not matter to the time)
        weights = list(torch.empty((-(-3 * l2 // weight.nbytes), n, k), dtype=weight.dtype, device=weight.device))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    times = {}
    for tile in CANDIDATES + (FP8_CANDIDATES if weight.element_size() == 1 else []):
        try:
            times[tile] = captured_seconds(
                lambda i: _run(x, weights[i % len(weights)], y, gated, tile, scale),
                calls=max(8, 2 * len(weights)),
                replays=3,
            )
        except triton.runtime.errors.OutOfResources:  # a tile this GPU cannot hold
            continue
    return min(times, key=times.get)


@triton.jit
def _load_x(x_ptr, cols, col_ok, K, GATED: tl.constexpr):
    """x[cols] in fp32; GATED: x is [gate | up] (2K wide) and the input is SiLU(gate) * up, rounded
    to x's dtype as `triton_layers.silu_and_mul` rounds it (so both paths give the same bits)."""
    if GATED:
        gate = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        x = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _load_w(w_rows, k0, K, BLOCK_K: tl.constexpr):
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _tile_product(w, x_ptr, k0, K, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    cols = k0 + tl.arange(0, BLOCK_K)
    return w.to(tl.float32) * _load_x(x_ptr, cols, cols < K, K, GATED)[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,  # SCALED: float32 [N], output row n's scale
    y_ptr,
    peers_ptr,
    N,
    K,
    stride_w,
    part_offset,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    GATED: tl.constexpr,
    PEERS: tl.constexpr,
    SCALED: tl.constexpr,  # the weight is e4m3 (cast to fp32 as loaded): the sums times scale
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # out-of-range rows re-read row 0 (harmless, never stored)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    # the weights are no kernel's output: the first tile's loads go out before the wait for the kernel
    # before (under PDL, while it finishes), and only x waits for it. One tile ahead, not more
    # (docs/performance.md, "Weight-streaming GEMV"). The scales are weights too.
    w = _load_w(w_rows, 0, K, BLOCK_K)
    if SCALED:
        scale = tl.load(scale_ptr + rows)
    wait_and_release(USE_PDL)
    acc = _tile_product(w, x_ptr, 0, K, BLOCK_K, GATED)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc += _tile_product(_load_w(w_rows, k0, K, BLOCK_K), x_ptr, k0, K, BLOCK_K, GATED)
    y = tl.sum(acc, axis=1)
    if SCALED:
        y = y * scale
    y = y.to(y_ptr.dtype.element_ty)
    if PEERS == 0:
        tl.store(y_ptr + rows, y, mask=row_ok)
    else:  # a tensor-parallel partial sum, pushed into every rank's exchange slot (`push`)
        lamport_push(peers_ptr, part_offset, rows, y, row_ok, PEERS)


def gemv(x: torch.Tensor, weight: torch.Tensor, push: Any = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T -> [1, N] in x's dtype (fp32 accumulation). An e4m3 weight
    (torch.float8_e4m3fn, compute capability 8.9 or newer) takes `scale`, float32 [N]: y[n] =
    (sum_k w[n, k] x[k]) * scale[n], rounded once. With PDL on, `weight` and `scale` are read before
    the kernel just before has finished: they must be no output of that kernel (model weights never
    are). `push`: see `_launch`."""
    assert x.dim() == 2 and x.shape[0] == 1, f"gemv takes one row, got {tuple(x.shape)}"
    assert x.shape[1] == weight.shape[1] and weight.stride(1) == 1, "weight must be [N, K] with contiguous rows"
    return _launch(x, weight, gated=False, push=push, scale=scale)


def gemv_silu_mul(
    h: torch.Tensor, weight: torch.Tensor, push: Any = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight.T for one row h = [gate | up] ([1, 2K]) and weight [N, K]: the MLP's
    activation read inside its down projection's GEMV, one kernel instead of two (the same bits as
    `gemv(silu_and_mul(h), weight)`). An e4m3 weight takes `scale` as in `gemv`."""
    assert h.dim() == 2 and h.shape[0] == 1, f"gemv_silu_mul takes one row, got {tuple(h.shape)}"
    assert h.shape[1] == 2 * weight.shape[1] and weight.stride(1) == 1, (
        "h must be [1, 2K] and weight [N, K] with contiguous rows"
    )
    return _launch(h, weight, gated=True, push=push, scale=scale)


def _check_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        assert scale is None, f"scale is for float8_e4m3fn weights; a {weight.dtype} weight takes none: drop it"
        return
    assert scale is not None, "a float8_e4m3fn weight [N, K] takes its per-row scale: pass scale, float32 [N]"
    assert scale.dtype == torch.float32 and scale.shape == weight.shape[:1] and scale.stride(0) == 1, (
        f"scale must be a contiguous float32 [N] = [{weight.shape[0]}], got {scale.dtype} {tuple(scale.shape)}"
    )


def tuned_tiles() -> dict[tuple, tuple[int, int, int]]:
    """The tiles tuned so far in this process: (N, K, weight dtype, x dtype, device) -> (BLOCK_N,
    BLOCK_K, num_warps), a copy. Empty under TRITON_INTERPRET=1, which uses one small tile."""
    return dict(_tiles)


def run_tile(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    tile: tuple[int, int, int],
    num_stages: int = 1,
    pdl: bool = False,
    scale: torch.Tensor | None = None,
) -> None:
    """y = x @ weight.T with a given tile (BLOCK_N, BLOCK_K, num_warps) and software-pipeline depth,
    launched as a programmatic dependent when `pdl` (whatever `INFER_PDL` says): one launch for tile
    sweeps (`infer.bench.gemv_sweep`). x [1, K], weight [N, K] with contiguous rows (e4m3 with its
    `scale` as in `gemv`), y [1, N]."""
    _check_scale(weight, scale)
    n, k = weight.shape
    block_n, block_k, warps = tile
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y if scale is None else scale,
        y,
        y,
        n,
        k,
        weight.stride(0),
        0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GATED=False,
        PEERS=0,
        SCALED=scale is not None,
        num_warps=warps,
        num_stages=num_stages,
        **({"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}),
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, gated: bool, push: Any, scale: torch.Tensor | None) -> torch.Tensor:
    """`push`: a tensor-parallel exchange's target (`infer.distributed.all_reduce.lamport.PushTarget`): the result, this
    rank's partial sum, is stored into every rank's slot for it (peer memory) and returned as the
    view of this rank's own copy, which the exchange then sums (`infer.distributed.layers.reduce_add_norm`) and
    resets: the view holds the partial sum until then."""
    _check_scale(weight, scale)
    x = x.contiguous()
    if push is None:
        y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    else:
        y = push.local
        assert y.shape == (1, weight.shape[0]) and y.dtype == x.dtype, "the push target is one row of the output"
    _run(x, weight, y, gated, _tile(x, weight, gated, scale), scale, push)
    return y


def _run(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    gated: bool,
    tile: tuple[int, int, int],
    scale: torch.Tensor | None,
    push: Any = None,
) -> None:
    n, k = weight.shape
    block_n, block_k, warps = tile
    peers, offset = (y, 0) if push is None else (push.peers, push.offset)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y if scale is None else scale,
        y,
        peers,
        n,
        k,
        weight.stride(0),
        offset,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GATED=gated,
        PEERS=0 if push is None else len(push.peers),
        SCALED=scale is not None,
        num_warps=warps,
        num_stages=1,
        **kernel_args(x.device),
    )
