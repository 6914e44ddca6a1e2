"""Scatter new K/V into the paged cache: token t goes to slot `slot_mapping[t]` (`cache_write`), or
the same with the rotary embedding applied to q and k on the way (`rotary_cache_write`). Into an FP8
cache (`FP8`, a constexpr: the kernels without it are unchanged) each value is quantized on the way
(`fp8.quantize`, with 1 / k_scale and 1 / v_scale)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.layers import rotate_halves
from infer.kernels.triton_pdl import kernel_args, wait_and_release
from infer.plugins.attention.paged_cuda.kernels.fp8 import quantize


@triton.jit
def _slot_base(slot_mapping_ptr, t, block_size, stride_cb, stride_cs):
    """Where token t's slot starts in a paged cache [num_blocks, block_size, ...] (int64: block *
    stride_cb overflows int32 for caches over 2^31 elements)."""
    slot = tl.load(slot_mapping_ptr + t)
    return (slot // block_size).to(tl.int64) * stride_cb + (slot % block_size) * stride_cs


@triton.jit
def _store(ptr, x, mask, scale_inv, FP8: tl.constexpr):
    """x into the cache at ptr: cast to its dtype, or quantized with scale_inv into an FP8 one."""
    if FP8:
        tl.store(ptr, quantize(x, scale_inv, ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cache_write_kernel(
    k_ptr,
    v_ptr,  # [T, Hkv, D], any strides (k, v are often views into a fused qkv)
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides (block, slot, head); D is contiguous
    block_size,
    num_kv_heads,
    head_dim,
    k_scale_inv,
    v_scale_inv,  # FP8: 1 / the layer's k_scale, v_scale
    FP8: tl.constexpr,  # the cache is e4m3: quantize each value
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = _slot_base(slot_mapping_ptr, t, block_size, stride_cb, stride_cs) + heads * stride_ch + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    _store(k_cache_ptr + dst, k, mask, k_scale_inv, FP8)
    _store(v_cache_ptr + dst, v, mask, v_scale_inv, FP8)


def cache_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride()
    _cache_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        1.0 / scales[0],
        1.0 / scales[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **kernel_args(k.device),
    )


@triton.jit
def _rotary_cache_write_kernel(
    pos_ptr,  # [T] positions
    q_ptr,
    k_ptr,
    v_ptr,  # [T, H, D], [T, Hkv, D], [T, Hkv, D]: views into a fused qkv (token strides given)
    cos_ptr,
    sin_ptr,  # [P, D/2] float32
    q_out_ptr,  # [T, H, D] contiguous
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_qt,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    k_scale_inv,
    v_scale_inv,  # FP8: 1 / the layer's k_scale, v_scale
    FP8: tl.constexpr,  # the cache is e4m3: quantize each value
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + d)
    sin = tl.load(sin_ptr + pos * HALF + d)
    # q: rotated halves, rounded to q's dtype as the rotary layer rounds them
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_ok = hq < NUM_Q
    q1, q2 = rotate_halves(q_ptr + t * stride_qt + hq * (2 * HALF) + d, q_ok, cos, sin, HALF)
    dst = q_out_ptr + t * (NUM_Q * 2 * HALF) + hq * (2 * HALF) + d
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    # k rotated (rounded to k's dtype, then the cache's) and v as it is, into the token's cache slot
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    kv_ok = hk < NUM_KV
    cache = _slot_base(slot_mapping_ptr, t, block_size, stride_cb, stride_cs) + hk * stride_ch + d
    k1, k2 = rotate_halves(k_ptr + t * stride_kt + hk * (2 * HALF) + d, kv_ok, cos, sin, HALF)
    _store(k_cache_ptr + cache, k1.to(k_ptr.dtype.element_ty), kv_ok, k_scale_inv, FP8)
    _store(k_cache_ptr + cache + HALF, k2.to(k_ptr.dtype.element_ty), kv_ok, k_scale_inv, FP8)
    src = v_ptr + t * stride_vt + hk * (2 * HALF) + d
    for part in tl.static_range(2):
        v = tl.load(src + part * HALF, mask=kv_ok)
        _store(v_cache_ptr + cache + part * HALF, v, kv_ok, v_scale_inv, FP8)


def rotary_cache_write(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [P, D/2] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> torch.Tensor:
    """The rotary embedding applied to q and k, and `cache_write` of the rotated k and v, in one
    kernel: returns the rotated q ([T, H, D], contiguous); the same bits as the rotary layer's kernel
    followed by `cache_write`. head_dim / 2 must be a power of two (`fits`)."""
    num_tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    assert fits(head_dim), f"head_dim / 2 must be a power of two, got head_dim {head_dim}"
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous within a token"
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    q_out = torch.empty(num_tokens, num_q, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens:
        _rotary_cache_write_kernel[(num_tokens,)](
            positions,
            q,
            k,
            v,
            cos,
            sin,
            q_out,
            k_cache,
            v_cache,
            slot_mapping,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_cache.shape[1],
            1.0 / scales[0],
            1.0 / scales[1],
            FP8=k_cache.dtype == torch.float8_e4m3fn,
            NUM_Q=num_q,
            NUM_KV=num_kv,
            HALF=head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q),
            BLOCK_HKV=triton.next_power_of_2(num_kv),
            **kernel_args(q.device),
        )
    return q_out


def fits(head_dim: int) -> bool:
    """Whether `rotary_cache_write` takes this head size (its halves are one power-of-two tile)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0
