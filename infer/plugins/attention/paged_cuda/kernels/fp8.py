"""What the kernels share about an FP8 (e4m3) KV cache: how a value is stored, and how one is read.

A write stores clamp(x * (1 / scale), -448, 448) rounded to the nearest e4m3 value, ties to even
(`infer.kernels.e4m3.quantize`): the bits the `torch` backend stores. A read needs no conversion
from here: the decode and prefill kernels cast the loaded e4m3 to their dot dtype (exact), fold
k_scale into the logits' scale, and multiply the output by v_scale (`scale_output`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from infer.kernels.e4m3 import quantize

__all__ = ["quantize", "scale_output"]


@triton.jit
def scale_output(out, v_scale, KV_FP8: tl.constexpr):
    """Attention output over an FP8 cache's stored values, times v_scale (a softmax-weighted sum of
    v_cache * v_scale); without an FP8 cache, `out` as it is."""
    if KV_FP8:
        out = out * v_scale
    return out
