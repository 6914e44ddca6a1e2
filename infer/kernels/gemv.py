"""Matrix-vector product for one-token steps (batch-1 decode), and for a few rows, in Triton.

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
the weights, are loaded before the wait. One row of e4m3 x (an activation quantized per row) against
e4m3 weights may instead take `infer.kernels.gemv_e4m3` (`Tile.f16_sums`: the products summed in f16
pairs, no widening of each weight to fp32), where the tuner finds it faster.

Up to GEMV_MAX_ROWS rows of x (a small batch, speculative decoding's verify step) share one read
of the weights: each weight tile meets every row, as fp32 FMAs over [M, BLOCK_N, BLOCK_K], or on
tensor cores (`Tile.mma`: x padded to 16 rows, the weights cast to x's bf16/fp16, exact from e4m3,
summed in fp32), whichever the tuner finds faster. M is a constexpr (one compile per row count);
one row is the one-row kernel as it was, bits included. Rows of an M-row call are not bitwise
their one-row calls: the sums go in another order.

Tiles (`infer.kernels.gemv_tiles`: from CANDIDATES; FP8_CANDIDATES too for 1-byte weights,
MMA_CANDIDATES for several rows) are tuned once per (N, K, dtypes, device, M) at the first call for a shape, which must come
before any CUDA graph capture (the engine's warm-up makes it; inside a capture it raises): each
candidate is timed the way a decode step runs it, launched back to back in a CUDA graph over
weights that do not fit in L2 (copies of the weight's shape when it would), as programmatic
dependents when those are on. One tile per shape serves the plain, PDL and gated forms, so all
give the same bits. Under TRITON_INTERPRET=1 one small FMA tile is used. Why not Triton's
autotuner, and what was measured: docs/performance.md, "Weight-streaming GEMV".
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer.common import env
from infer.kernels import gemv_e4m3, warmup
from infer.kernels.gemv_tiles import INTERPRETER_TILE, Tile, candidates, tune
from infer.kernels.layers import lamport_push
from infer.kernels.triton_pdl import kernel_args, wait_and_release

GEMV_MAX_ROWS = 8  # rows of x one call takes: each weight tile is read once and used for all of them
# read once: the kernels below are interpreted or compiled as TRITON_INTERPRET was when they were
# decorated (at this import), and _tile runs at every launch
_INTERPRETED = env.triton_interpret()
_tiles: dict[tuple, Tile] = {}


def _tile_key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return (*weight.shape, weight.dtype, x.dtype, weight.device, x.shape[0])


def _tile(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> Tile:
    """The tuned tile for this call's shapes and dtypes (tuned at its first call: `gemv_tiles.tune`);
    `y`: the call's output, whose shape and dtype the tuner's own output takes (default: x's dtype)."""
    if _INTERPRETED:
        return INTERPRETER_TILE
    key = _tile_key(x, weight)
    if key not in _tiles:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) if y is None else y
        y = torch.empty_like(out)  # the tuner's calls write here, not into the caller's output
        _tiles[key] = tune(
            candidates(x, weight), weight, lambda tile, w: _run(x, w, y, gated, tile, scale, x_scale=x_scale)
        )
    return _tiles[key]


@triton.jit
def _load_x(x_ptr, cols, col_ok, K, GATED: tl.constexpr):
    """x[cols] in fp32 (x_ptr and cols may be blocks: [M, 1] row starts and [1, BLOCK_K]); GATED: x is
    [gate | up] (2K wide) and the input is SiLU(gate) * up, rounded to x's dtype as
    `triton_layers.silu_and_mul` rounds it (so both paths give the same bits)."""
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
    """One row of x: [BLOCK_N, BLOCK_K] products w * x."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return w.to(tl.float32) * _load_x(x_ptr, cols, cols < K, K, GATED)[None, :]


@triton.jit
def _tile_products(w, x_rows, k0, K, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """Every row of x ([BLOCK_M, 1] row starts): [BLOCK_M, BLOCK_N, BLOCK_K] products w * x."""
    cols = (k0 + tl.arange(0, BLOCK_K))[None, :]
    x = _load_x(x_rows, cols, cols < K, K, GATED)
    return w.to(tl.float32)[None, :, :] * x[:, None, :]


@triton.jit
def _mma_sums(w, w_rows, x_rows, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """[BLOCK_N, 16] sums of the weight rows with 16 rows of x ([16, 1] row starts) on tensor cores:
    the weights cast to x's dtype (exact from e4m3), the products summed in fp32."""
    dtype = x_rows.dtype.element_ty
    cols = tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc = tl.dot(w.to(dtype), tl.trans(_load_x(x_rows, cols, cols < K, K, GATED).to(dtype)), acc)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _load_x(x_rows, k0 + cols, k0 + cols < K, K, GATED).to(dtype)
        acc = tl.dot(_load_w(w_rows, k0, K, BLOCK_K).to(dtype), tl.trans(x), acc)
    return acc


@triton.jit
def _row_sums(
    w,
    w_rows,
    x_ptr,
    stride_x,
    K,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    MMA: tl.constexpr,
):
    """sum_k w[n, k] x[m, k] in fp32, the weight tile `w` at k = 0 already loaded: [BLOCK_N] for one
    row of x (the one-row kernel's order of operations, so its bits), else [BLOCK_M, BLOCK_N], on
    tensor cores (MMA, BLOCK_M 16) or in FMAs."""
    if M == 1:
        acc = _tile_product(w, x_ptr, 0, K, BLOCK_K, GATED)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            acc += _tile_product(_load_w(w_rows, k0, K, BLOCK_K), x_ptr, k0, K, BLOCK_K, GATED)
        sums = tl.sum(acc, axis=1)
    else:
        m = tl.arange(0, BLOCK_M)
        x_rows = x_ptr + tl.where(m < M, m, 0)[:, None] * stride_x  # padding rows re-read row 0, never stored
        if MMA:
            sums = tl.trans(_mma_sums(w, w_rows, x_rows, K, BLOCK_N, BLOCK_K, GATED))
        else:
            acc = _tile_products(w, x_rows, 0, K, BLOCK_K, GATED)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                acc += _tile_products(_load_w(w_rows, k0, K, BLOCK_K), x_rows, k0, K, BLOCK_K, GATED)
            sums = tl.sum(acc, axis=2)
    return sums


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,  # SCALED: float32 [N], output row n's scale
    x_scale_ptr,  # X_SCALED: float32 [M], x row m's scale (x is e4m3: an activation quantized per row)
    y_ptr,
    peers_ptr,
    N,
    K,
    stride_x,
    stride_w,
    part_offset,
    M: tl.constexpr,  # rows of x and y
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two, 16 with MMA
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    GATED: tl.constexpr,
    PEERS: tl.constexpr,  # push targets (M == 1 only)
    SCALED: tl.constexpr,  # the weight is e4m3 (cast to fp32 as loaded): the sums times scale
    X_SCALED: tl.constexpr,  # x is e4m3 too: the sums times its row's scale
    MMA: tl.constexpr,  # M > 1 rows on tensor cores (`Tile.mma`)
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
    y = _row_sums(w, w_rows, x_ptr, stride_x, K, M, BLOCK_M, BLOCK_N, BLOCK_K, GATED, MMA)
    if SCALED:
        y = y * scale
    if X_SCALED:
        if M == 1:
            y = y * tl.load(x_scale_ptr)
        else:
            m = tl.arange(0, BLOCK_M)
            y = y * tl.load(x_scale_ptr + tl.where(m < M, m, 0))[:, None]
    y = y.to(y_ptr.dtype.element_ty)
    if M > 1:
        m = tl.arange(0, BLOCK_M)[:, None]
        tl.store(y_ptr + m * N + rows[None, :], y, mask=(m < M) & row_ok[None, :])
    elif PEERS == 0:
        tl.store(y_ptr + rows, y, mask=row_ok)
    else:  # a tensor-parallel partial sum, pushed into every rank's exchange slot (`push`)
        lamport_push(peers_ptr, part_offset, rows, y, row_ok, PEERS)


def takes_rows(x: torch.Tensor, weight: torch.Tensor, push: Any = None) -> bool:
    """Whether `gemv(x, weight, push=push)` serves x's rows well: one row always; 2 to GEMV_MAX_ROWS rows
    (never pushed: a pushed partial sum is one row's) when their tile is tuned, or may be now (the engine
    is warming up: `infer.kernels.warmup`). Else a GEMM should."""
    m = x.shape[0] if x.dim() == 2 else 0
    if m == 1:
        return True
    if not 1 < m <= GEMV_MAX_ROWS or push is not None:
        return False
    if _INTERPRETED or not x.is_cuda:  # one small tile under the interpreter, nothing to tune
        return _INTERPRETED and warmup.is_warming_up()
    return warmup.is_warming_up() or _tile_key(x, weight) in _tiles


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    push: Any = None,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (fp32 accumulation; an e4m3 row on an
    `f16_sums` tile sums each 16 products in f16 first), 1 <= M <= GEMV_MAX_ROWS:
    the weights are read once for all rows. An e4m3 weight (torch.float8_e4m3fn, compute capability
    8.9 or newer) takes `scale`, float32 [N]: y[m, n] = (sum_k w[n, k] x[m, k]) * scale[n], rounded
    once. An e4m3 x (an activation quantized per row, no MMA tiles) takes `x_scale`, float32 [M, 1],
    which multiplies row m's sums too, and the output dtype `out_dtype`. With PDL on, `weight` and
    `scale` are read before the kernel just before has finished: they must be no output of that kernel
    (model weights never are). `push` (one row only): see `_launch`."""
    assert x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS, (
        f"gemv takes 1 to {GEMV_MAX_ROWS} rows, got {tuple(x.shape)}"
    )
    assert x.shape[1] == weight.shape[1] and weight.stride(1) == 1, "weight must be [N, K] with contiguous rows"
    if x.dtype == torch.float8_e4m3fn:
        assert x_scale is not None and out_dtype is not None, "an e4m3 x takes x_scale [M, 1] and out_dtype"
        assert x_scale.dtype == torch.float32 and x_scale.numel() == x.shape[0], "x_scale: float32 [M, 1]"
    else:
        assert x_scale is None, "x_scale is for an e4m3 x"
    return _launch(x, weight, gated=False, push=push, scale=scale, x_scale=x_scale, out_dtype=out_dtype)


def gemv_silu_mul(
    h: torch.Tensor, weight: torch.Tensor, push: Any = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight.T for rows h = [gate | up] ([M, 2K], 1 <= M <= GEMV_MAX_ROWS) and
    weight [N, K]: the MLP's activation read inside its down projection's GEMV, one kernel instead of
    two (the same bits as `gemv(silu_and_mul(h), weight)`). `scale` and `push` as in `gemv`."""
    assert h.dim() == 2 and 1 <= h.shape[0] <= GEMV_MAX_ROWS, (
        f"gemv_silu_mul takes 1 to {GEMV_MAX_ROWS} rows, got {tuple(h.shape)}"
    )
    assert h.shape[1] == 2 * weight.shape[1] and weight.stride(1) == 1, (
        "h must be [M, 2K] and weight [N, K] with contiguous rows"
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


def tuned_tiles() -> dict[tuple, Tile]:
    """The tiles tuned so far in this process: (N, K, weight dtype, x dtype, device, M) -> `Tile`, a
    copy. Empty under TRITON_INTERPRET=1, which uses one small tile."""
    return dict(_tiles)


def run_tile(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    tile: tuple,
    num_stages: int | None = None,
    pdl: bool = False,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> None:
    """y = x @ weight.T with a given tile (a `Tile`, or its first fields: (BLOCK_N, BLOCK_K,
    num_warps)), its software-pipeline depth replaced by `num_stages` if given, launched as a
    programmatic dependent when `pdl` (whatever `INFER_PDL` says): one launch for tile sweeps
    (`benchmarks.lab.gemv_sweep`). x [M, K] contiguous, weight [N, K] with contiguous rows (e4m3 with
    its `scale`, and an e4m3 x with its `x_scale`, as in `gemv`), y [M, N] contiguous."""
    _check_scale(weight, scale)
    tile = Tile(*tile) if num_stages is None else Tile(*tile)._replace(num_stages=num_stages)
    assert not tile.mma or x.dtype in (torch.bfloat16, torch.float16), "an MMA tile takes bf16 or fp16 x"
    launch = {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}
    _run(x, weight, y, False, tile, scale, launch=launch, x_scale=x_scale)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool,
    push: Any,
    scale: torch.Tensor | None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`push`: a tensor-parallel exchange's target (`infer.distributed.all_reduce.lamport.PushTarget`): the result, this
    rank's partial sum, is stored into every rank's slot for it (peer memory) and returned as the
    view of this rank's own copy, which the exchange then sums (`infer.distributed.layers.reduce_add_norm`) and
    resets: the view holds the partial sum until then."""
    _check_scale(weight, scale)
    x = x.contiguous()
    if push is None:
        y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    else:
        y = push.local
        assert x.shape[0] == 1, f"a pushed partial sum is one row's, got {x.shape[0]} rows"
        assert y.shape == (1, weight.shape[0]) and y.dtype == (out_dtype or x.dtype), "the push target is one row"
    _run(x, weight, y, gated, _tile(x, weight, gated, scale, x_scale, y), scale, push, x_scale=x_scale)
    return y


def _run(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    gated: bool,
    tile: Tile,
    scale: torch.Tensor | None,
    push: Any = None,
    launch: dict[str, Any] | None = None,  # the PDL keywords, if not `kernel_args`'
    x_scale: torch.Tensor | None = None,
) -> None:
    n, k = weight.shape
    mma = tile.mma and x.shape[0] > 1  # one row takes the FMA kernel whatever the tile
    peers, offset = (y, 0) if push is None else (push.peers, push.offset)
    launch = kernel_args(x.device) if launch is None else launch
    # an f16_sums tile's call that its kernel cannot take (a push, an x off an 8-byte boundary) runs
    # the FMA kernel at the same tile shape
    if tile.f16_sums and push is None and x_scale is not None and gemv_e4m3.takes(x, weight):
        gemv_e4m3.run(x, weight, y, tile, scale, x_scale, launch)
        return
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x,
        weight,
        y if scale is None else scale,
        y if x_scale is None else x_scale,
        y,
        peers,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        offset,
        M=x.shape[0],
        BLOCK_M=16 if mma else triton.next_power_of_2(x.shape[0]),
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GATED=gated,
        PEERS=0 if push is None else len(push.peers),
        SCALED=scale is not None,
        X_SCALED=x_scale is not None,
        MMA=mma,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **launch,
    )
