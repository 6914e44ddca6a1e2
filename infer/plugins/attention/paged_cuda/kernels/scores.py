"""What the decode and prefill kernels share about a query-key score: its logit (the softmax scale in
log2 units, since their online softmax runs on exp2, and Gemma 2's soft cap) and the oldest key a
sliding window lets a query see."""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def logits(s, scale_log2, SOFT_CAP: tl.constexpr):
    """Scores s = q.k (fp32) as log2-unit logits: s * scale * log2(e), or, capped (SOFT_CAP = c),
    c * tanh(s * scale / c) * log2(e). tanh is 1 - 2 / (2^(2x log2(e)) + 1): Triton's interpreter has
    no libdevice; it is exactly -1 and 1 at the ends and within 1e-7 of tanh in between."""
    if SOFT_CAP is None:
        return s * scale_log2
    else:
        x = s * (scale_log2 / (SOFT_CAP * _LOG2E))  # s * scale / c
        tanh = 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)
        return tanh * (SOFT_CAP * _LOG2E)


@triton.jit
def window_start(pos, WINDOW: tl.constexpr):
    """The oldest key position a query at `pos` sees under a window of WINDOW tokens (itself included)."""
    return tl.maximum(pos - WINDOW + 1, 0)
