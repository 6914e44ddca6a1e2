"""W4A16 matrix-vector product for decode rows, in Triton: the 4-bit weight streamed, dequantized in registers.

At a few rows a linear layer is a weight stream (`infer.kernels.gemv`); a 4-bit weight is a quarter of
its bf16 bytes, so the stream is the whole win, and dequantizing the weight into memory first would
write and read it again at 16 bits (more rows do that, `infer.kernels.int4_dequant`, and cuBLAS multiplies). Here each program streams
BLOCK_N rows of the packed weight (`Int4Linear`'s form: uint8 [N, K/2], column 2j in the low nibble),
BLOCK_J bytes (2 BLOCK_J columns) at a time: the low and high nibbles meet x's even and odd columns, each
dequantized as (q - z) * s with its group's float32 scale and zero point, and every row of x (M of them,
at most INT4_GEMV_MAX_ROWS) meets each tile in fp32 FMAs; the sums are rounded once to x's dtype.

Groups: where a tile's columns lie in one group (no act-order, and 2 BLOCK_J divides the group size)
each row's scale and zero are loaded once a tile; else (act-order's `g_idx`, or a group narrower than a
tile) each column's are gathered through `g_idx`. The result equals x @ dequantized(W).T up to the order
of the float32 sums (`infer.kernels.int4_reference` is the reference the tests hold it to).

Fixed tiles for now: not yet tuned on a GPU (`infer.kernels.gemv_tiles` tunes the bf16 and FP8 GEMVs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT4_GEMV_MAX_ROWS = 8  # rows of x one call takes; more: `infer.kernels.int4_dequant`


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
        tile_ok = row_ok[:, None] & j_ok[None, :]
        q = tl.load(q_ptr + rows[:, None] * half + js[None, :], mask=tile_ok, other=0)
        lo = (q & 0xF).to(tl.float32)
        hi = (q >> 4).to(tl.float32)
        if ONE_GROUP:
            g = (2 * j0) // GROUP
            s = tl.load(s_ptr + rows * G + g, mask=row_ok, other=0.0)[:, None]
            z = tl.load(z_ptr + rows * G + g, mask=row_ok, other=0).to(tl.float32)[:, None]
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
        x_at = x_ptr + ms[:, None] * stride_xm + 2 * js[None, :]
        x_ok = m_ok[:, None] & j_ok[None, :]
        x_even = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0).to(tl.float32)
        acc += tl.sum(x_even[:, None, :] * w_even[None, :, :] + x_odd[:, None, :] * w_odd[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


def _tile(rows: int, group: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_J): fewer weight rows a program as x's rows grow (the [M, N, 2J] products live in
    registers); a tile as wide as the group allows, at most 128 columns."""
    block_n = 32 if rows <= 2 else 16
    return block_n, max(8, min(64, group // 2))


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    group: int,
    act_order: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias for x [M, K] (M <= INT4_GEMV_MAX_ROWS) and the 4-bit W in `Int4Linear`'s form:
    qweight uint8 [N, K/2], scales float32 [N, G], zeros uint8 [N, G], g_idx int32 [K]; `group` columns a
    group where `act_order` is False (else each column's group is g_idx's)."""
    m, k = x.shape
    n = qweight.shape[0]
    if not 1 <= m <= INT4_GEMV_MAX_ROWS:
        raise ValueError(f"int4_gemv takes 1 to {INT4_GEMV_MAX_ROWS} rows, not {m}")
    if qweight.shape[1] * 2 != k or k % 2:
        raise ValueError(f"x has {k} columns and the packed weight {qweight.shape[1] * 2}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_j = _tile(m, group)
    one_group = not act_order and group % (2 * block_j) == 0
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else y, y,
        n, k, scales.shape[1], x.stride(0), y.stride(0),
        M=m, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_J=block_j, GROUP=group,
        ONE_GROUP=one_group, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y
