"""How this project's Triton kernels store a value as FP8 (e4m3): clamp(x * scale_inv, -448, 448)
rounded to the nearest e4m3 value, ties to even. These are the bits of
`torch.Tensor.to(torch.float8_e4m3fn)` after the same clamp (`infer.runtime.kv_cache.quantize_fp8`).
Compiled, Triton's cast (`cvt.rn.satfinite`, one instruction for two values) rounds that way itself.
Triton's interpreter truncates instead a mantissa that rounds up into the next power of two (1.99
becomes 1.0), so there (how CI runs the kernels) the value is first rounded in float32 arithmetic
(`round_e4m3`) and the cast after it is exact. The rounding is some twenty instructions a value: a
one-token row quantized by one program took 2x the time with it on an H200 (docs/performance.md,
"FP8 activations (W8A8)"). The FP8 KV cache's write (`paged-cuda`) and the activation quantizers
(`infer.kernels.fp8`) take it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infer.common import env

# read once: the kernels are interpreted or compiled as TRITON_INTERPRET was at this import
_INTERPRETED = tl.constexpr(env.triton_interpret())
E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6; below it e4m3 is subnormal, in steps of 2^-9
SIGN_BIT = tl.constexpr(-0x80000000)  # float32's sign bit, as an int32


@triton.jit
def round_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still float32."""
    # normal: keep 3 of float32's 23 mantissa bits, rounding on the integer bits (a carry moves the exponent)
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal: a multiple of 2^-9; |x| * 512 < 8 is exact, its integer part and remainder too
    y = tl.abs(x) * 512.0
    n = y.to(tl.int32)  # truncation toward zero: the floor of y >= 0
    rest = y - n.to(tl.float32)
    n = tl.where((rest > 0.5) | ((rest == 0.5) & ((n & 1) == 1)), n + 1, n)
    # x's sign bit onto |result|, so that a negative x rounding to zero stays -0.0 as torch stores it
    # (compiled, `-sub` of a zero is +0.0: the negation is a subtraction from zero)
    sub = (n.to(tl.float32) * (1.0 / 512.0)).to(tl.int32, bitcast=True) | (bits & SIGN_BIT)
    return tl.where(tl.abs(x) < E4M3_MIN_NORMAL, sub.to(tl.float32, bitcast=True), normal)


@triton.jit
def quantize(x, scale_inv, dtype: tl.constexpr):
    """x as an e4m3 `dtype` value standing for x: x * scale_inv, clamped to +-448 and rounded."""
    y = tl.clamp(x.to(tl.float32) * scale_inv, -E4M3_MAX, E4M3_MAX)
    if _INTERPRETED:
        y = round_e4m3(y)
    return y.to(dtype)
