"""The 4-bit weight dequantized into memory at 16 bits, in Triton, for products of more rows than the GEMV
takes (prefill chunks, large decode batches): cuBLAS then multiplies it.

`Int4Linear` did this with torch operations, several passes over a float32 copy of the weight a call.
Here one pass: each program reads a [BLOCK_N, BLOCK_J] tile of the packed weight (`Int4Linear`'s form:
uint8 [N, K/2], column 2j in the low nibble), dequantizes the low and high nibbles as (q - z) * s in
float32 as the GEMV does (`infer.kernels.int4_gemv.dequantized_tile`), and writes them interleaved, rounded to the output's dtype: the values
`Int4Linear.dequantized(dtype)` gives. The write and cuBLAS's read of it are the cost a fused W4A16 GEMM
would save (a Triton one, dequantizing each tile on its way to `tl.dot`, untuned, took steps of more than
8 rows in a random-256x256 run at 0.10x bf16's throughput on an H100, the GEMV the smaller steps:
docs/performance.md, "4-bit weights on the GPU").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.int4_gemv import dequantized_tile


@triton.jit
def _int4_dequant_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    w_ptr,
    N,
    K,
    G,  # groups a weight row
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,  # packed bytes a tile: 2 BLOCK_J columns
    GROUP: tl.constexpr,  # columns a group (without act-order)
    ONE_GROUP: tl.constexpr,  # each tile's columns lie in one group
    ACT_ORDER: tl.constexpr,  # each column's group is g_idx's (else column // GROUP)
):
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j0 = tl.program_id(1) * BLOCK_J
    js = j0 + tl.arange(0, BLOCK_J)
    half = K // 2
    n_ok = ns < N
    j_ok = js < half
    even, odd = dequantized_tile(
        q_ptr, s_ptr, z_ptr, g_ptr, ns, n_ok, js, j_ok, j0, half, G, GROUP, ONE_GROUP, ACT_ORDER
    )
    w = tl.reshape(tl.join(even, odd), (BLOCK_N, 2 * BLOCK_J))  # columns 2j and 2j + 1 side by side
    cols = 2 * j0 + tl.arange(0, 2 * BLOCK_J)
    out = w_ptr + ns[:, None].to(tl.int64) * K + cols[None, :]
    tl.store(out, w.to(w_ptr.dtype.element_ty), mask=n_ok[:, None] & (cols[None, :] < K))


def int4_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    group: int,
    act_order: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W [N, K] in `dtype`, (q - z) * s computed in float32, from `Int4Linear`'s form: qweight uint8
    [N, K/2], scales float32 [N, G], zeros uint8 [N, G], g_idx int32 [K]; `group` columns a group where
    `act_order` is False (else each column's group is g_idx's)."""
    n, half = qweight.shape
    k = 2 * half
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_j = 32, 64
    one_group = not act_order and group % (2 * block_j) == 0
    _int4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(half, block_j))](
        qweight, scales, zeros, g_idx, w, n, k, scales.shape[1],
        BLOCK_N=block_n, BLOCK_J=block_j, GROUP=group, ONE_GROUP=one_group, ACT_ORDER=act_order,
    )  # fmt: skip
    return w
