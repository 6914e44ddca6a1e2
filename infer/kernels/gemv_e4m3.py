"""One row of e4m3 activations against e4m3 weights, the products summed in f16 pairs: the one-token
FP8 GEMV at the speed of reading its weights (Hopper and Ada; PTX, so never under the interpreter).

The FMA form (`infer.kernels.gemv`) widens every weight to fp32 before its FMA: two conversions a
weight pair (e4m3x2 -> f16x2 -> two f32), 141 instructions for a thread's 32 weights at gate_up's tile,
which keeps the issue slots 77% busy and the GEMV 4-14% short of a plain read of its bytes. Here the
weights stop at f16x2: a `cvt.rn.f16x2.e4m3x2` a pair and one `fma.rn.f16x2` a pair against x's f16x2,
16 products summed in f16x2 (8 in each half) before one conversion to fp32 and one fp32 add (76
instructions for the same 32 weights). x is converted once for all of a program's rows, scaled by 2^-8
on the way (exact), so that |w x| <= 448 * 1.75 = 784 and a half's sum of 8 stays below 6,272, far
inside f16's 65,504; the 2^8 comes back in the epilogue with the scales:
y[n] = (sum_k w[n, k] x[k]) * scale[n] * x_scale * 256.

What the f16 sums cost in precision: each partial sum is rounded to 11 significant bits (fp32's 24
before) at each of its 8 steps, and a product below 2^-14 (w x < 2^-6, two values near the bottom of
e4m3's range) keeps fewer. Against the float64 sum of the same e4m3 values, in an fp32 output: up to
~2^-13 of the row's sum of |terms| where one product dominates the row (an outlier weight meeting an
outlier activation: 2^-8 at the very worst), ~2^-15 at most on Gaussian rows (`tests/gpu/test_gemv_gpu.py`
bounds both). That is of the order of the bf16 output's own rounding, and far under the e4m3
quantization of x and w themselves (2^-4 relative, each).

Tiles: `Tile(..., f16_sums=True)`, among the tuner's candidates when `fits` (`gemv_tiles.candidates`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer.common import env
from infer.kernels.triton_pdl import wait_and_release

# 8 e4m3 values of x (one b64) -> four f16x2 words, times 2^-8 (exact: an exponent shift)
X_ASM = tl.constexpr("""{
.reg .b32 lo, hi, s; .reg .b16 a, b, c, d;
mov.b64 {lo, hi}, $4; mov.b32 {a, b}, lo; mov.b32 {c, d}, hi; mov.b32 s, 0x1C001C00;
cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; cvt.rn.f16x2.e4m3x2 $2, c; cvt.rn.f16x2.e4m3x2 $3, d;
mul.rn.f16x2 $0, $0, s; mul.rn.f16x2 $1, $1, s; mul.rn.f16x2 $2, $2, s; mul.rn.f16x2 $3, $3, s;
}""")
# 16 e4m3 weights (two b64) against eight f16x2 words of x: the products summed in f16x2, then the
# two halves in fp32
PRODUCTS_ASM = tl.constexpr("""{
.reg .b32 lo, hi, a, b, c, d, p; .reg .b16 w0, w1, w2, w3, p0, p1; .reg .f32 f0, f1;
mov.b64 {lo, hi}, $1; mov.b32 {w0, w1}, lo; mov.b32 {w2, w3}, hi;
cvt.rn.f16x2.e4m3x2 a, w0; cvt.rn.f16x2.e4m3x2 b, w1; cvt.rn.f16x2.e4m3x2 c, w2; cvt.rn.f16x2.e4m3x2 d, w3;
mul.rn.f16x2 p, a, $3; fma.rn.f16x2 p, b, $4, p; fma.rn.f16x2 p, c, $5, p; fma.rn.f16x2 p, d, $6, p;
mov.b64 {lo, hi}, $2; mov.b32 {w0, w1}, lo; mov.b32 {w2, w3}, hi;
cvt.rn.f16x2.e4m3x2 a, w0; cvt.rn.f16x2.e4m3x2 b, w1; cvt.rn.f16x2.e4m3x2 c, w2; cvt.rn.f16x2.e4m3x2 d, w3;
fma.rn.f16x2 p, a, $7, p; fma.rn.f16x2 p, b, $8, p; fma.rn.f16x2 p, c, $9, p; fma.rn.f16x2 p, d, $10, p;
mov.b32 {p0, p1}, p; cvt.f32.f16 f0, p0; cvt.f32.f16 f1, p1; add.f32 $0, f0, f1;
}""")


@triton.jit
def _words(ptr, k0, cols, n_words, EVEN: tl.constexpr, evict: tl.constexpr):
    """Words k0 + cols, 8 e4m3 values each: of x (ptr its start, cols [WORDS]) or of the weight's rows
    (ptr [BLOCK_N, 1] row starts, cols [1, WORDS])."""
    if EVEN:
        return tl.load(ptr + k0 + cols, eviction_policy=evict)
    return tl.load(ptr + k0 + cols, mask=k0 + cols < n_words, other=0, eviction_policy=evict)


@triton.jit
def _x_halves(x_words):
    """[WORDS] words of x -> eight [WORDS // 2] f16x2 tensors: an even word's four, then an odd word's."""
    even, odd = tl.split(tl.reshape(x_words, [x_words.shape[0] // 2, 2]))
    a0, a1, a2, a3 = tl.inline_asm_elementwise(
        X_ASM, "=r,=r,=r,=r,l", [even], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1
    )
    b0, b1, b2, b3 = tl.inline_asm_elementwise(
        X_ASM, "=r,=r,=r,=r,l", [odd], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1
    )
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _products(w_words, x_words):
    """[BLOCK_N, WORDS // 2] fp32 sums of 16 products each: w_words [BLOCK_N, WORDS], x_words [WORDS]."""
    w_even, w_odd = tl.split(tl.reshape(w_words, [w_words.shape[0], w_words.shape[1] // 2, 2]))
    a0, a1, a2, a3, b0, b1, b2, b3 = _x_halves(x_words)
    return tl.inline_asm_elementwise(
        PRODUCTS_ASM,
        "=f,l,l,r,r,r,r,r,r,r,r",
        [w_even, w_odd, a0[None, :], a1[None, :], a2[None, :], a3[None, :]]
        + [b0[None, :], b1[None, :], b2[None, :], b3[None, :]],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _gemv_e4m3_kernel(
    x_ptr,  # e4m3 [K]: one row
    w_ptr,  # e4m3 [N, K], rows stride_w apart
    scale_ptr,  # float32 [N]
    x_scale_ptr,  # float32 [1]
    y_ptr,
    N,
    K,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # K % BLOCK_K == 0: no masks
    USE_PDL: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # out-of-range rows re-read row 0 (harmless, never stored)
    n_words = K // 8
    w_rows = w_ptr.to(tl.pointer_type(tl.int64)) + rows[:, None].to(tl.int64) * (stride_w // 8)
    x_words = x_ptr.to(tl.pointer_type(tl.int64))
    cols = tl.arange(0, WORDS)
    # the weights and scales are no kernel's output: loaded before the wait, as in the FMA form
    w = _words(w_rows, 0, cols[None, :], n_words, EVEN, "evict_first")
    scale = tl.load(scale_ptr + rows)
    wait_and_release(USE_PDL)
    acc = _products(w, _words(x_words, 0, cols, n_words, EVEN, ""))
    for k0 in range(WORDS, n_words, WORDS):
        w = _words(w_rows, k0, cols[None, :], n_words, EVEN, "evict_first")
        acc += _products(w, _words(x_words, k0, cols, n_words, EVEN, ""))
    y = tl.sum(acc, axis=1) * (scale * (tl.load(x_scale_ptr) * 256.0))
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel may be tuned for `x @ weight.T`: operands it `takes`, on a CUDA GPU of
    compute capability 8.9 or newer, compiled (not interpreted)."""
    return (
        takes(x, weight)
        and x.is_cuda
        and not env.triton_interpret()
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of e4m3 x against e4m3 weights, K a multiple of 16, x contiguous and the weight's rows
    contiguous, both 8-byte aligned (the kernel reads 8 values a word). Checked at every launch
    (`infer.kernels.gemv._run`: a call it refuses takes the FMA kernel); the rest of `fits` holds for
    a shape's tuned tile once it held at tuning."""
    return (
        x.dtype == weight.dtype == torch.float8_e4m3fn
        and x.dim() == 2
        and x.shape[0] == 1
        and weight.shape[1] % 16 == 0
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.stride(0) % 8 == 0
        and weight.data_ptr() % 8 == 0
        and x.data_ptr() % 8 == 0
    )


def run(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    tile: Any,
    scale: torch.Tensor,
    x_scale: torch.Tensor,
    launch: dict[str, Any],
) -> None:
    """y = (x @ weight.T) * scale * x_scale for `fits` operands with a `Tile` (its block_n, block_k,
    num_warps, num_stages), launched with `launch` (the PDL keywords). No push: the FP8 layers' partial sums are
    all-reduced, not pushed (`infer.kernels.gemv._launch`)."""
    n, k = weight.shape
    _gemv_e4m3_kernel[(triton.cdiv(n, tile.block_n),)](
        x,
        weight,
        scale,
        x_scale,
        y,
        n,
        k,
        weight.stride(0),
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        EVEN=k % tile.block_k == 0,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **launch,
    )
