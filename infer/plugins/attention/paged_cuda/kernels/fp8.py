"""What the kernels share about an FP8 (e4m3) KV cache: how a value is stored, and how one is read.

A write stores clamp(x * (1 / scale), -448, 448) rounded to the nearest e4m3 value, ties to even
(`infer.kernels.e4m3.quantize`): the bits the `torch` backend stores. A read casts the loaded e4m3
to the dot dtype (exact; the decode kernel's values through `widen_values`), folds k_scale into the
logits' scale, and multiplies the output by v_scale (`scale_output`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from infer.kernels.e4m3 import quantize

__all__ = ["quantize", "scale_output", "widen_values"]


@triton.jit
def scale_output(out, v_scale, KV_FP8: tl.constexpr):
    """Attention output over an FP8 cache's stored values, times v_scale (a softmax-weighted sum of
    v_cache * v_scale); without an FP8 cache, `out` as it is."""
    if KV_FP8:
        out = out * v_scale
    return out


@triton.jit
def widen_values(v, mask, DOT_DTYPE: tl.constexpr):
    """A tile of values [N, D] as P @ V's operand in DOT_DTYPE; `mask` [N, D] or [N, 1]: where the
    tile holds real values (the rest become 0). P @ V sums over tokens, so the MMA wants each thread's
    values from consecutive tokens: of an e4m3 tile, one byte of each of several rows. Cast plainly,
    Triton moves the cast past shared memory and gathers those bytes one load each; the select, a
    second tensor operand, keeps the tile widened to DOT_DTYPE before shared memory, whence it loads
    transposed 16 bits at a time (docs/performance.md, "An FP8 cache's decode")."""
    if v.dtype == tl.float8e4nv:
        return tl.where(mask, v.to(DOT_DTYPE), 0.0)
    else:
        return v.to(DOT_DTYPE)
