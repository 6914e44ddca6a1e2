"""Triton kernels of the `paged-cuda` attention backend.

Each submodule imports triton at its top, so import them only where they are about to run
(`paged_cuda.PagedCudaAttention` does so when it is built); this package imports no triton itself.

- `cache_write`: new K/V into their slots of the paged cache (`slot_mapping`).
- `decode`: one query token per sequence over its block table, split-K over partitions + reduce.
- `decode_e4m3`: the same over an FP8 cache with K and V loaded straight into MMA registers (PTX;
  unsplit batches, compiled runs only); its PTX strings in `decode_e4m3_ptx` (no triton import).
- `prefill`: variable-length causal prefill/extend over the paged cache (`cu_seqlens_q`).
- `scores`: what both share about a score: its logit (scale, soft cap) and a sliding window's start.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.common import env

__all__ = ["dot_config", "interpreted"]

# read once, at import: Triton fixes TRITON_INTERPRET for a kernel when it decorates it (at the import
# of its submodule, which imports this package first), and dot_config runs at every launch
_INTERPRETED = env.triton_interpret()


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1, as in CI)."""
    return _INTERPRETED


def dot_config(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> tuple[Any, str]:
    """(operand dtype, input_precision) for the kernels' `tl.dot`s on activations of `dtype` over a
    cache of `kv_dtype` (default: `dtype`)."""
    import triton.language as tl

    if dtype == torch.float32:
        return tl.float32, "ieee"  # fp32 caches keep fp32 accuracy, not tf32's 10-bit mantissa
    if kv_dtype == torch.float8_e4m3fn:
        # An FP8 cache's tiles become f16 (exact: e4m3 fits f16's range and mantissa), which Hopper
        # and Ada convert in one instruction per two values; bf16 goes through f16 and f32 (three).
        # q and the softmax weights p lose nothing as f16 either (|q| far below 65504, p in [0, 1]).
        return tl.float16, "tf32"
    if _INTERPRETED and dtype == torch.bfloat16:
        # Triton's interpreter multiplies bf16 operands as their raw uint16 bits (numpy has no
        # bf16), so under it bf16 dots run in fp32; compiled kernels use bf16 MMAs.
        return tl.float32, "ieee"
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype], "tf32"
