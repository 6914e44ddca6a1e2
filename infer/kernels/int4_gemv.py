"""W4A16 matrix-vector product for decode rows, in Triton: the 4-bit weight streamed, dequantized in registers.

At a few rows a linear layer is a weight stream (`infer.kernels.gemv`); a 4-bit weight is a quarter of
its bf16 bytes, so the stream is the whole win, and dequantizing the weight into memory first would
write and read it again at 16 bits (more rows do that, `infer.kernels.int4_dequant`, for cuBLAS). Each
program here streams
BLOCK_N rows of the packed weight (`Int4Linear`'s form: uint8 [N, K/2], column 2j in the low nibble),
BLOCK_J bytes (2 BLOCK_J columns) at a time: the low and high nibbles meet x's even and odd columns, each
dequantized as (q - z) * s with its group's float32 scale and zero point, and every row of x (M of them,
at most INT4_GEMV_MAX_ROWS) meets each tile in fp32 FMAs; the sums are rounded once to x's dtype.

Groups: where a step's columns lie in one group (no act-order, and 2 BLOCK_J divides the group size)
each row's scale and zero are loaded once a step; where a step spans several groups (no act-order) each
column's group is its index over the group size, its scale and zero gathered from the row's few; under
act-order each column's group is read from `g_idx`. The result equals x @ dequantized(W).T up to the
order of the float32 sums (`infer.kernels.int4_reference` is the reference the tests hold it to).

Tiles are tuned per shape at its first call while the engine warms up, as the bf16 and FP8 GEMVs' are
(`infer.kernels.gemv_tiles.tune`: timed back to back in a CUDA graph over weights that do not fit in L2),
among `candidates`, the fixed tile of before included; a shape first met mid-run, or in a graph's
capture, takes that fixed tile (one compile, no tuning).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer.common import env
from infer.kernels import warmup

INT4_GEMV_MAX_ROWS = 8  # rows of x one call takes; more: `infer.kernels.int4_dequant`


@triton.jit
def dequantized_tile(
    q_ptr, s_ptr, z_ptr, g_ptr, rows, row_ok, js, j_ok, j0, half, G,
    GROUP: tl.constexpr, ONE_GROUP: tl.constexpr, ACT_ORDER: tl.constexpr,
):  # fmt: skip
    """The [rows, js] tile of the packed weight (uint8 [N, K/2], column 2j in the low nibble) as its even
    and odd columns, (q - z) * s in float32: one scale and zero a row where the step lies in one group
    (`ONE_GROUP`, j0 its first byte), each column's group by index over GROUP without act-order, or read
    from `g_idx` under it. `infer.kernels.int4_dequant` writes the same values to memory."""
    tile_ok = row_ok[:, None] & j_ok[None, :]
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * half + js[None, :], mask=tile_ok, other=0)
    lo = (q & 0xF).to(tl.float32)
    hi = (q >> 4).to(tl.float32)
    if ONE_GROUP:
        g = (2 * j0) // GROUP
        s = tl.load(s_ptr + rows * G + g, mask=row_ok, other=0.0)[:, None]
        z = tl.load(z_ptr + rows * G + g, mask=row_ok, other=0).to(tl.float32)[:, None]
        w_even = (lo - z) * s
        w_odd = (hi - z) * s
    elif not ACT_ORDER:  # a step over several groups: columns 2j and 2j + 1 share one (GROUP is even)
        g = (2 * js) // GROUP
        at = rows[:, None] * G + g[None, :]
        s = tl.load(s_ptr + at, mask=tile_ok, other=0.0)
        z = tl.load(z_ptr + at, mask=tile_ok, other=0).to(tl.float32)
        w_even = (lo - z) * s
        w_odd = (hi - z) * s
    else:
        g_even = tl.load(g_ptr + 2 * js, mask=j_ok, other=0)
        g_odd = tl.load(g_ptr + 2 * js + 1, mask=j_ok, other=0)
        s_even = tl.load(s_ptr + rows[:, None] * G + g_even[None, :], mask=tile_ok, other=0.0)
        z_even = tl.load(z_ptr + rows[:, None] * G + g_even[None, :], mask=tile_ok, other=0).to(tl.float32)
        s_odd = tl.load(s_ptr + rows[:, None] * G + g_odd[None, :], mask=tile_ok, other=0.0)
        z_odd = tl.load(z_ptr + rows[:, None] * G + g_odd[None, :], mask=tile_ok, other=0).to(tl.float32)
        w_even = (lo - z_even) * s_even
        w_odd = (hi - z_odd) * s_odd
    return w_even, w_odd


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    G,  # groups a row
    stride_xm,
    stride_ym,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,  # packed bytes a tile: 2 BLOCK_J columns
    GROUP: tl.constexpr,  # columns a group (without act-order)
    ONE_GROUP: tl.constexpr,  # each tile's columns lie in one group: a scale and zero a row per tile
    ACT_ORDER: tl.constexpr,  # each column's group is g_idx's (else column // GROUP)
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    half = K // 2
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, half, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        j_ok = js < half
        w_even, w_odd = dequantized_tile(
            q_ptr, s_ptr, z_ptr, g_ptr, rows, row_ok, js, j_ok, j0, half, G, GROUP, ONE_GROUP, ACT_ORDER
        )
        x_at = x_ptr + ms[:, None] * stride_xm + 2 * js[None, :]
        x_ok = m_ok[:, None] & j_ok[None, :]
        x_even = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0).to(tl.float32)
        acc += tl.sum(x_even[:, None, :] * w_even[None, :, :] + x_odd[:, None, :] * w_odd[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


class Int4Tile(NamedTuple):
    """How a call is launched: BLOCK_N weight rows a program, BLOCK_J packed bytes (2 BLOCK_J columns) a
    step, its warps and software-pipeline stages."""

    block_n: int
    block_j: int
    num_warps: int = 4
    num_stages: int = 3


# tried for each shape at its first call while the engine warms up (`gemv_tiles.tune`): the fixed tiles of
# before (`default_tile`) among them, so a tuned tile is never slower than those as timed; the others keep
# more bytes in flight (a 32-row, 64-byte step left the stream at about 0.4 TB/s on an H100: each program
# waited on each 2 KB load), up to 8,192 products a step ([rows, BLOCK_N, 2 BLOCK_J] in registers)
CANDIDATES = [Int4Tile(*t) for t in [(1, 512, 4), (2, 256, 4), (4, 128, 2), (4, 256, 4), (8, 128, 4)]]
_tiles: dict[tuple, Int4Tile] = {}
_INTERPRETED = env.triton_interpret()


def default_tile(rows: int, group: int) -> Int4Tile:
    """The tile a call takes untuned: fewer weight rows a program as x's rows grow (the [M, N, 2J] products
    live in registers); a step as wide as the group allows, at most 128 columns."""
    return Int4Tile(32 if rows <= 2 else 16, max(8, min(64, group // 2)))


def candidates(rows: int, group: int) -> list[Int4Tile]:
    """The tiles tuned for `rows` rows: the default, and those whose products fit in registers (rows x
    BLOCK_N x 2 BLOCK_J <= 8,192 fp32 values a program)."""
    padded = triton.next_power_of_2(rows)
    return [default_tile(rows, group)] + [t for t in CANDIDATES if padded * t.block_n * 2 * t.block_j <= 8192]


def tuned_tiles() -> dict[tuple, Int4Tile]:
    """The tiles tuned so far, by (N, K / 2, group, act-order, x's dtype, device)."""
    return dict(_tiles)


def _launch(x, qweight, scales, zeros, g_idx, group, act_order, bias, y, tile: Int4Tile) -> None:
    m, k = x.shape
    n = qweight.shape[0]
    one_group = not act_order and group % (2 * tile.block_j) == 0
    _int4_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else y, y,
        n, k, scales.shape[1], x.stride(0), y.stride(0),
        M=m, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=tile.block_n, BLOCK_J=tile.block_j, GROUP=group,
        ONE_GROUP=one_group, ACT_ORDER=act_order, HAS_BIAS=bias is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _tile(x, qweight, scales, zeros, g_idx, group, act_order, bias) -> Int4Tile:
    """The shape's tile, tuned for one row at its first one-row call while the engine warms up (never in a
    CUDA graph's capture, never mid-run: an untuned shape met then takes `default_tile`, compiled once).
    Several rows take the one-row tile where their products fit, else the default (a tuning per row count
    would compile every candidate again for each)."""
    rows = x.shape[0]
    key = (*qweight.shape, group, act_order, x.dtype, x.device)
    tile = _tiles.get(key)
    if tile is not None:
        return tile if tile in candidates(rows, group) else default_tile(rows, group)
    if rows > 1 or _INTERPRETED or not warmup.is_warming_up() or torch.cuda.is_current_stream_capturing():
        return default_tile(rows, group)
    from infer.kernels.gemv_tiles import tune

    y = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    tiles = candidates(1, group)
    _tiles[key] = tune(tiles, qweight, lambda t, w: _launch(x, w, scales, zeros, g_idx, group, act_order, bias, y, t))
    return _tiles[key]


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    group: int,
    act_order: bool,
    bias: torch.Tensor | None = None,
    tile: Int4Tile | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias for x [M, K] (M <= INT4_GEMV_MAX_ROWS) and the 4-bit W in `Int4Linear`'s form:
    qweight uint8 [N, K/2], scales float32 [N, G], zeros uint8 [N, G], g_idx int32 [K]; `group` columns a
    group where `act_order` is False (else each column's group is g_idx's). `tile`: this launch shape
    rather than the shape's tuned one (`_tile`)."""
    m, k = x.shape
    if not 1 <= m <= INT4_GEMV_MAX_ROWS:
        raise ValueError(f"int4_gemv takes 1 to {INT4_GEMV_MAX_ROWS} rows, not {m}")
    if qweight.shape[1] * 2 != k or k % 2:
        raise ValueError(f"x has {k} columns and the packed weight {qweight.shape[1] * 2}")
    if not act_order and group % 2:
        raise ValueError(f"groups of {group} columns: the GEMV takes an even group size")
    x = x.contiguous()
    y = torch.empty(m, qweight.shape[0], dtype=x.dtype, device=x.device)
    if tile is None:
        tile = _tile(x, qweight, scales, zeros, g_idx, group, act_order, bias)
    _launch(x, qweight, scales, zeros, g_idx, group, act_order, bias, y, tile)
    return y
