"""Scatter new K/V into the paged cache: token t goes to slot `slot_mapping[t]`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.plugins.triton_pdl import kernel_args, wait_and_release


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D], any strides (k, v are often views into a fused qkv)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head); D is contiguous
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    block, offset = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    # int64: block * stride_cb overflows int32 for caches over 2^31 elements.
    dst = block.to(tl.int64) * stride_cb + offset * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def cache_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride()
    _cache_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        **kernel_args(k.device),
    )
