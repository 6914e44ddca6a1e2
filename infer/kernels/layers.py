"""Triton kernels behind the fused layers. One program per token row."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer.kernels.triton_pdl import kernel_args, wait_and_release


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    _add_norm_store(
        x, res_ptr + row * N, w_ptr, out_ptr + row * N, res_out_ptr + row * N, eps, cols, mask, N, HAS_RESIDUAL
    )


@triton.jit
def add_norm(
    x,
    res_ptr,
    w_ptr,
    res_out_ptr,
    eps,
    cols,
    mask,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_X: tl.constexpr = False,
):
    """One row's RMSNorm(x + residual) * w (x fp32), rounded to the activation dtype (res_out_ptr's),
    0 in masked columns; stores x + residual at res_out_ptr. Without a residual, STORE_X stores x
    itself (rounded) as the residual out. The fused FP8 norm (`infer.kernels.fp8`) takes it too."""
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL or STORE_X:
        x = x.to(res_out_ptr.dtype.element_ty)  # the eager layer adds in the activation dtype
        tl.store(res_out_ptr + cols, x, mask=mask)
        x = x.to(tl.float32)
    # the sum of squares in float64, rounded once to float32: whatever order the compiler sums in (a
    # kernel that stores e4m3 lays the row out unlike one that stores 16 bits), the sums differ by float64
    # ulps and round alike but in the rare row where a float32 midpoint falls between them
    x2 = x.to(tl.float64) * x.to(tl.float64)
    mean = tl.sum(x2, axis=0).to(tl.float32) / N
    # match the eager layer: normalise in fp32, cast to the activation dtype, then scale
    normed = (x * tl.rsqrt(mean + eps)).to(res_out_ptr.dtype.element_ty)
    # w * normed rounded once, as the eager layer's product (an fp32 product of two 16-bit floats is exact;
    # multiplied in bfloat16 Triton's interpreter gets it wrong)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed.to(tl.float32)).to(res_out_ptr.dtype.element_ty)


@triton.jit
def _add_norm_store(
    x,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    cols,
    mask,
    N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_X: tl.constexpr = False,
):
    """`add_norm`, its result stored at out_ptr."""
    y = add_norm(x, res_ptr, w_ptr, res_out_ptr, eps, cols, mask, N, HAS_RESIDUAL, STORE_X)
    tl.store(out_ptr + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    # x: [T, N] (contiguous); with a residual returns (normed(x + residual), x + residual)
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res_in = residual.contiguous() if residual is not None else x
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            res_in,
            weight,
            out,
            res_out,
            eps,
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
            **kernel_args(x.device),
        )
    return out if residual is None else (out, res_out)


@triton.jit
def rotate_halves(src, ok, cos, sin, HALF: tl.constexpr):
    """The Neox-style rotary embedding of the heads whose first halves `src` points at ([H, HALF];
    `ok` masks the heads): (x1 * cos - x2 * sin, x2 * cos + x1 * sin) in fp32. The rotary kernel and
    the cache write that rotates (`rotary_cache_write`) both take it, so both round alike."""
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride,
    k_stride,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + d)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + d)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    for is_k in tl.static_range(2):
        src = k_ptr if is_k else q_ptr
        dst = k_out_ptr if is_k else q_out_ptr
        stride = k_stride if is_k else q_stride
        num = NUM_K if is_k else NUM_Q
        mask = heads < num
        r1, r2 = rotate_halves(src + token * stride + heads * (2 * HALF) + d[None, :], mask, cos, sin, HALF)
        out_base = token * num * 2 * HALF + heads * (2 * HALF) + d[None, :]
        tl.store(dst + out_base, r1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + out_base + HALF, r2.to(dst.dtype.element_ty), mask=mask)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, H, D], k: [T, Hkv, D] (views into the fused qkv output: the token stride is passed);
    # cos, sin: [P, D/2] float32. Returns new contiguous q and k.
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == dim and k.stride(1) == dim
    q_out = torch.empty(tokens, num_q, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_k, dim, dtype=k.dtype, device=k.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            positions,
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            q.stride(0),
            k.stride(0),
            NUM_Q=num_q,
            NUM_K=num_k,
            HALF=dim // 2,
            BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
            **kernel_args(q.device),
        )
    return q_out, k_out


@triton.jit
def act_and_mul(gate, up, GELU: tl.constexpr):
    """act(gate) * up (gate fp32, up in the activation dtype), in the activation dtype: act(gate) is
    rounded to it first, as the eager layer does, and the product rounded once (an fp32 product of two
    16-bit floats is exact; multiplied in bfloat16 Triton's interpreter gets it wrong)."""
    if GELU:  # tanh approximation: 0.5 g (1 + tanh(u)); tanh from exp(-2|u|), which cannot overflow
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(u < 0.0, -tanh, tanh))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return (act.to(up.dtype).to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_and_release(USE_PDL)
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, act_and_mul(gate, up, GELU), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    x = x.contiguous()
    rows, n2 = x.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        grid = (rows, triton.cdiv(n, block))
        _act_and_mul_kernel[grid](x, out, N=n, BLOCK=block, GELU=gelu, **kernel_args(x.device))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] (gate then up) -> [T, I]
    return _act_and_mul(x, gelu=False)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I]
    return _act_and_mul(x, gelu=True)


@triton.jit
def lamport_push(peers_ptr, part_offset, idx, y, mask, PEERS: tl.constexpr):
    """The writer's half of the exchange (`infer.distributed.all_reduce.lamport`): stores this rank's part `y` at
    `part_offset + idx` of every rank's slot (`peers_ptr`: PEERS addresses), a -0.0 as +0.0, since
    -0.0 means "not written yet" there. The GEMV's epilogue and the embedding's push take it."""
    y = tl.where(y == 0.0, tl.zeros_like(y), y)
    for r in tl.static_range(PEERS):
        dst = tl.load(peers_ptr + r).to(tl.pointer_type(y.dtype))
        tl.store(dst + part_offset + idx, y, mask=mask)


@triton.jit
def _lamport_add_norm_kernel(
    slot_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    N: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Under PDL this kernel starts while the GEMV that pushes this rank's part still runs: the parts
    # are read as they arrive, and the wait for the GEMV to finish comes only before the stores (the
    # outputs may be memory the GEMV still reads, handed on by the caching allocator). Waiting first,
    # as the other kernels do, was slower (docs/performance.md, "Lamport exchange").
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # the ranks' parts arrive over peer memory: read them until none holds -0.0 (the reset value;
    # a pushed -0.0 is stored as +0.0), summing in rank order so every rank gets the same bits
    x = tl.zeros([BLOCK], tl.float32)
    waiting = 1
    while waiting > 0:
        waiting = 0
        x = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):
            part = tl.load(slot_ptr + r * N + cols, mask=mask, other=0.0, volatile=True)
            waiting += tl.sum((part.to(tl.int16, bitcast=True) == -32768).to(tl.int32), axis=0)
            x += part.to(tl.float32)
    tl.debug_barrier()  # every thread has read its elements before any is reset
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    reset = tl.full([BLOCK], -32768, tl.int16).to(slot_ptr.dtype.element_ty, bitcast=True)
    for r in tl.static_range(WORLD):
        tl.store(slot_ptr + r * N + cols, reset, mask=mask)
    if NORM:  # with the residual added, or the sum being the residual (the first layer's input)
        _add_norm_store(x, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, cols, mask, N, RESIDUAL, not RESIDUAL)
    else:
        tl.store(out_ptr + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


def lamport_reduce(
    slot: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None, eps: float = 0.0
):
    """The sum of the ranks' parts in `slot` ([world, N] on this rank, written by the ranks over peer
    memory, -0.0 where not yet written), waiting on the GPU until all have arrived, then resetting
    the slot to -0.0. With `weight`: (RMSNorm(sum + residual) * weight, sum + residual) as `rms_norm`
    gives them (without `residual`: of the sum alone, which is returned as the residual), else the
    sum [1, N]."""
    world, n = slot.shape
    out = torch.empty(1, n, dtype=slot.dtype, device=slot.device)
    norm = weight is not None
    res_out = torch.empty_like(out) if norm else out
    _lamport_add_norm_kernel[(1,)](
        slot,
        out if residual is None else residual.contiguous(),
        weight if norm else out,
        out,
        res_out,
        eps,
        N=n,
        WORLD=world,
        BLOCK=triton.next_power_of_2(n),
        NORM=norm,
        RESIDUAL=residual is not None,
        num_warps=16,
        **kernel_args(slot.device),
    )  # 16 warps: faster than 8 at tp 2 (docs/performance.md, "Lamport exchange")
    return (out, res_out) if norm else out


@triton.jit
def _embed_push_kernel(
    ids_ptr,
    w_ptr,
    peers_ptr,
    start,
    num_local,
    part_offset,
    N: tl.constexpr,
    PEERS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    local = tl.load(ids_ptr) - start
    inside = (local >= 0) & (local < num_local)
    row = tl.load(w_ptr + tl.where(inside, local, 0).to(tl.int64) * N + cols, mask=mask, other=0.0)
    # zeros for an id outside this rank's rows
    lamport_push(peers_ptr, part_offset, cols, tl.where(inside, row, tl.zeros_like(row)), mask, PEERS)


def embedding_push(ids: torch.Tensor, weight: torch.Tensor, start: int, num_local: int, push: Any) -> torch.Tensor:
    """A vocab-parallel embedding of one token pushed into the ranks' exchange (`push`, a
    `infer.distributed.all_reduce.lamport.PushTarget`): this rank's row of `weight` ([per_rank, N], rows for ids
    start .. start + num_local) or zeros. Returns this rank's part (the exchange sums it)."""
    n = weight.shape[1]
    assert ids.numel() == 1 and weight.stride(1) == 1 and push.local.shape == (1, n)
    _embed_push_kernel[(1,)](
        ids,
        weight,
        push.peers,
        start,
        num_local,
        push.offset,
        N=n,
        PEERS=len(push.peers),
        BLOCK=triton.next_power_of_2(n),
        num_warps=4,
        **kernel_args(weight.device),
    )
    return push.local
