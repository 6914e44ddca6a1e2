"""The KV-cache view every attention backend reads: a layer's cache is the tuple (k, v), each
[num_blocks, block_size, num_kv_heads, head_dim], in the model's dtype or, for an FP8 cache, an
`FP8KVCache` that carries the float32 scales it is read with (`kv_scales`); `quantize_fp8` is what a
write stores. `write_kv` scatters a step's new K/V into their slots, `gather` reads blocks through a
block table and `dequantize` makes what was read the model's dtype: the torch reference backend is
built from these. The tensors themselves are allocated by the engine (`infer.runtime.kv_cache`)."""

from __future__ import annotations

import torch

from infer.api.attention import KVCache

__all__ = ["FP8", "FP8_MAX", "FP8KVCache", "dequantize", "gather", "kv_scales", "quantize_fp8", "write_kv"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, larger values are clamped to it on write


class FP8KVCache(tuple):
    """One layer's FP8 cache: (k, v), e4m3 tensors [num_blocks, block_size, num_kv_heads, head_dim], and
    the float32 scales they are read with: a stored key x means x * k_scale, a stored value y means
    y * v_scale. A write stores `quantize_fp8(k, k_scale)`.

    It is a tuple, so whatever moves a layer's (k, v) (the block mover, swaps, CUDA graphs) moves it
    as it moves any cache; only attention backends with `capabilities.fp8_kv` read the scales. The
    scales are static, one pair a layer: a checkpoint's calibrated `k_scale` / `v_scale` where it holds
    them (`infer.loading.kv_scales`), else 1.0.
    e4m3 keeps 3 mantissa bits from 2^-6 to 448, so with scale 1 any K/V within +-448 keeps a relative
    error of at most 2^-4, and smaller values (below 2^-6) an absolute error of at most 2^-10. A scale
    moves that range, not the relative error: on SmolLM2 an amax / 448 scale leaves K and V as far off
    (2.6% RMS) as 1.0 does.
    """

    k_scale: float
    v_scale: float

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> "FP8KVCache":
        assert k.dtype == v.dtype == FP8, f"an FP8 cache holds {FP8}, not {k.dtype}"
        cache = super().__new__(cls, (k, v))
        cache.k_scale, cache.v_scale = float(k_scale), float(v_scale)
        return cache


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache stores for x: x * (1 / scale) in float32, clamped to +-448 and rounded to the
    nearest e4m3, ties to even (the reciprocal, not a division: a kernel computes the same product)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def kv_scales(kv_cache: KVCache) -> tuple[float, float]:
    """(k_scale, v_scale) a layer's cache is read with: 1.0 for a cache in the model's dtype."""
    return (kv_cache.k_scale, kv_cache.v_scale) if isinstance(kv_cache, FP8KVCache) else (1.0, 1.0)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values as `dtype`: e4m3 ones times their scale (in float32), others as they are."""
    return (stored.float() * scale).to(dtype) if stored.dtype == FP8 else stored.to(dtype)


def gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache[tables]: [N, bs, Hkv, D] -> [B, nb, bs, Hkv, D] (FP8 through its bytes, as every device indexes them)."""
    return cache.view(torch.uint8)[tables].view(FP8) if cache.dtype == FP8 else cache[tables]


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into their slots (an FP8 cache: quantized). k, v: [T, Hkv, D]; slot_mapping: [T]."""
    for cache, x, scale in zip(kv_cache, (k, v), kv_scales(kv_cache)):  # cache: [N, bs, Hkv, D]
        x = quantize_fp8(x, scale) if cache.dtype == FP8 else x.to(cache.dtype)
        if cache.dtype == FP8:  # torch has no index_copy_ for float8 on the CPU: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)
