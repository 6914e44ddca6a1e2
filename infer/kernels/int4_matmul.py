"""W4A16 matrix product for more rows than the GEMV takes (prefill chunks, large decode batches), in Triton.

`Int4Linear` used to dequantize its whole weight into memory for every such product (float32, then the
activation's dtype) and multiply that: three passes over a 16-bit copy of the weight a call. Here each
program computes a [BLOCK_M, BLOCK_N] tile of y = x @ W.T as a GEMM does, and dequantizes the weight's
tile in registers on its way to the tensor cores: BLOCK_J packed bytes (2 BLOCK_J columns) of BLOCK_N
weight rows (`Int4Linear`'s form: uint8 [N, K/2], column 2j in the low nibble) become two [BLOCK_J,
BLOCK_N] tiles, the even and the odd columns, each (q - z) * s in float32 rounded to x's dtype (as
`Int4Linear.dequantized` rounds the weight), and meet x's even and odd columns in two `tl.dot`s with
float32 sums. The weight is read once a column of tiles, at 4 bits; the dequantization's cost is one
tile's elementwise work per BLOCK_M rows.

Groups as in `infer.kernels.int4_gemv`: where a tile's columns lie in one group (no act-order, and 2
BLOCK_J divides the group size) a scale and zero a weight row per tile, else each column's gathered
through `g_idx`. Tiles by the row count (`_config`), not yet tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    G,  # groups a weight row
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,  # packed bytes a tile: 2 BLOCK_J columns
    GROUP_M: tl.constexpr,  # row tiles a band of programs sweeps before the next column of tiles (L2 reuse)
    GROUP: tl.constexpr,  # columns a group (without act-order)
    ONE_GROUP: tl.constexpr,  # each tile's columns lie in one group
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (tensor cores would round it to TF32)
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_m
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    half = K // 2
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, half, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        j_ok = js < half
        tile_ok = j_ok[:, None] & n_ok[None, :]
        q = tl.load(q_ptr + ns[None, :] * half + js[:, None], mask=tile_ok, other=0)  # [BLOCK_J, BLOCK_N]
        lo = (q & 0xF).to(tl.float32)
        hi = (q >> 4).to(tl.float32)
        if ONE_GROUP:
            g = (2 * j0) // GROUP
            s = tl.load(s_ptr + ns * G + g, mask=n_ok, other=0.0)[None, :]
            z = tl.load(z_ptr + ns * G + g, mask=n_ok, other=0).to(tl.float32)[None, :]
            w_even = (lo - z) * s
            w_odd = (hi - z) * s
        else:
            g_even = tl.load(g_ptr + 2 * js, mask=j_ok, other=0)
            g_odd = tl.load(g_ptr + 2 * js + 1, mask=j_ok, other=0)
            s_even = tl.load(s_ptr + ns[None, :] * G + g_even[:, None], mask=tile_ok, other=0.0)
            z_even = tl.load(z_ptr + ns[None, :] * G + g_even[:, None], mask=tile_ok, other=0).to(tl.float32)
            s_odd = tl.load(s_ptr + ns[None, :] * G + g_odd[:, None], mask=tile_ok, other=0.0)
            z_odd = tl.load(z_ptr + ns[None, :] * G + g_odd[:, None], mask=tile_ok, other=0).to(tl.float32)
            w_even = (lo - z_even) * s_even
            w_odd = (hi - z_odd) * s_odd
        x_at = x_ptr + ms[:, None] * stride_xm + 2 * js[None, :]
        x_ok = m_ok[:, None] & j_ok[None, :]
        x_even = tl.load(x_at, mask=x_ok, other=0.0)
        x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0)
        acc = tl.dot(x_even, w_even.to(x_even.dtype), acc, input_precision=PRECISION)
        acc = tl.dot(x_odd, w_odd.to(x_odd.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + ms[:, None] * stride_ym + ns[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(rows: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles by the row count: decode batches (a weight stream: narrow row tiles, many programs), then
    prefill chunks (a GEMM: 128 x 128 tiles); float32 halves the column tile (its tiles are twice the bytes)."""
    block_j = max(16, min(32, group // 2))  # 64 columns, or the group (tl.dot takes 16 or more)
    if dtype == torch.float32:
        block_j = 16
    if rows <= 32:
        return dict(
            BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64, BLOCK_J=block_j, num_warps=4, num_stages=4
        )
    if rows <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_J=block_j, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_J=block_j, num_warps=8, num_stages=3)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    group: int,
    act_order: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias for x [M, K] (any M) and the 4-bit W in `Int4Linear`'s form: qweight uint8
    [N, K/2], scales float32 [N, G], zeros uint8 [N, G], g_idx int32 [K]; `group` columns a group where
    `act_order` is False (else each column's group is g_idx's). y in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] * 2 != k or k % 2:
        raise ValueError(f"x has {k} columns and the packed weight {qweight.shape[1] * 2}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    config = _config(m, group, x.dtype)
    one_group = not act_order and group % (2 * config["BLOCK_J"]) == 0
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _int4_matmul_kernel[grid](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else y, y,
        m, n, k, scales.shape[1], x.stride(0), y.stride(0),
        GROUP_M=8, GROUP=group, ONE_GROUP=one_group, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **config,
    )  # fmt: skip
    return y
