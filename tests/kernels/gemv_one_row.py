"""The one-row GEMV kernel as it was before `infer.kernels.gemv` took several rows and FP8 weights,
kept as the reference for the bits of a one-row call with bf16/fp16 weights (without PDL and the
tensor-parallel push, which change no arithmetic)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _load_x(x_ptr, cols, col_ok, K, GATED: tl.constexpr):
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
def _one_row_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    w = _load_w(w_rows, 0, K, BLOCK_K)
    acc = _tile_product(w, x_ptr, 0, K, BLOCK_K, GATED)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        acc += _tile_product(_load_w(w_rows, k0, K, BLOCK_K), x_ptr, k0, K, BLOCK_K, GATED)
    y = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows, y, mask=row_ok)


def one_row_gemv(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int], gated: bool) -> torch.Tensor:
    """x [1, K] (gated: [1, 2K]) @ weight[N, K].T with the tile (BLOCK_N, BLOCK_K, num_warps)."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tile[:3]
    _one_row_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GATED=gated,
        num_warps=warps,
        num_stages=1,
    )
    return y
