"""Batched LoRA: each token's adapter's low-rank delta, y += (x A_s^T) B_s^T, for a batch mixing adapters.

The adapters live in stacked device slots, A [S, R, K] and B [S, N, R] (the scaling folded into B), and
a token names its slot (-1: none, y unchanged). Two shapes of work, after Punica:

- BGMV, a program per token: the token's slot is read on the device, so a decode step (or any step a
  CUDA graph replays) needs no host knowledge of the batch; grids depend on the token count alone.
- SGMV, a program per tile of a segment (consecutive tokens of one slot: a prompt's chunk): the
  adapter's A and B tiles are read once per tile of tokens and multiplied with `tl.dot`, which a long
  prompt needs; the segments come from the host, so it runs eagerly.

Each is two kernels: shrink (v = x A^T, [T, R] in float32) and expand (y += v B^T, in y's dtype).
`infer.kernels.lora_reference` is the same sum in torch, the CPU's path and the kernels' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_shrink(x_ptr, a_ptr, slots_ptr, v_ptr, K, R, sx, sa0, sa1, sv, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + slot.to(tl.int64) * sa0 + r[:, None] * sa1
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t.to(tl.int64) * sx + k, mask=k < K, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(ak * xk[None, :], axis=1)
    tl.store(v_ptr + t.to(tl.int64) * sv + r, acc, mask=r < R)


@triton.jit
def _bgmv_expand(v_ptr, b_ptr, slots_ptr, y_ptr, N, R, sv, sb0, sb1, sy, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    v = tl.load(v_ptr + t.to(tl.int64) * sv + r, mask=r < R, other=0.0)
    bt = tl.load(
        b_ptr + slot.to(tl.int64) * sb0 + n[:, None] * sb1 + r[None, :],
        mask=(n[:, None] < N) & (r[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(bt * v[None, :], axis=1)
    y_at = y_ptr + t.to(tl.int64) * sy + n
    y = tl.load(y_at, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _sgmv_shrink(
    x_ptr, a_ptr, seg_ptr, v_ptr, K, R, sx, sa0, sa1, sv,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + seg * 3)
    start = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * sx + k[None, :], mask=(m[:, None] < end) & (k[None, :] < K))
        at = tl.load(
            a_ptr + slot.to(tl.int64) * sa0 + r[None, :] * sa1 + k[:, None],
            mask=(r[None, :] < R) & (k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(xt.to(at.dtype), at)
    tl.store(v_ptr + m[:, None].to(tl.int64) * sv + r[None, :], acc, mask=(m[:, None] < end) & (r[None, :] < R))


@triton.jit
def _sgmv_expand(
    v_ptr, b_ptr, seg_ptr, y_ptr, N, R, sv, sb0, sb1, sy,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + seg * 3)
    start = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    bt = tl.load(
        b_ptr + slot.to(tl.int64) * sb0 + n[None, :] * sb1 + r[:, None],
        mask=(n[None, :] < N) & (r[:, None] < R),
        other=0.0,
    )
    v = tl.load(v_ptr + m[:, None].to(tl.int64) * sv + r[None, :], mask=(m[:, None] < end) & (r[None, :] < R))
    delta = tl.dot(v.to(bt.dtype), bt)
    mask = (m[:, None] < end) & (n[None, :] < N)
    y_at = y_ptr + m[:, None].to(tl.int64) * sy + n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def _block(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def bgmv(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, v: torch.Tensor
) -> None:
    """y[t] += (x[t] A_{slots[t]}^T) B_{slots[t]}^T for every token t with slots[t] >= 0, in place.
    x [T, K], y [T, N] (rows contiguous), a [S, R, K], b [S, N, R], slots [>= T] int32 on the device,
    v: a float32 scratch of at least [T, R]. Grids depend on T alone: CUDA-graph safe."""
    T, K = x.shape
    S, R, _ = a.shape
    N = y.shape[1]
    if T == 0:
        return
    block_r = _block(R)
    _bgmv_shrink[(T,)](x, a, slots, v, K, R, x.stride(0), a.stride(0), a.stride(1), v.stride(0), block_r, 128)
    block_n = 64
    _bgmv_expand[(T, triton.cdiv(N, block_n))](
        v, b, slots, y, N, R, v.stride(0), b.stride(0), b.stride(1), y.stride(0), block_r, block_n
    )


def sgmv(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    segments: torch.Tensor,
    max_len: int,
    v: torch.Tensor,
) -> None:
    """The same sum over segments [G, 3] int32 (slot, start, end) of consecutive tokens of one slot,
    the longest `max_len` tokens: a program per BLOCK_M tokens of a segment (and per BLOCK_N outputs)."""
    G = segments.shape[0]
    if G == 0:
        return
    T, K = x.shape
    _, R, _ = a.shape
    N = y.shape[1]
    block_m, block_r = 32, _block(R)
    tiles = triton.cdiv(max_len, block_m)
    _sgmv_shrink[(G, tiles)](
        x, a, segments, v, K, R, x.stride(0), a.stride(0), a.stride(1), v.stride(0), block_m, block_r, 64
    )
    block_n = 64
    _sgmv_expand[(G, tiles, triton.cdiv(N, block_n))](
        v, b, segments, y, N, R, v.stride(0), b.stride(0), b.stride(1), y.stride(0), block_m, block_r, block_n
    )
