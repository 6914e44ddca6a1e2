"""FP8 (e4m3) activations for W8A8 matrix products, the activation quantized inside the kernel that
makes it: RMSNorm, SiLU-and-mul (GELU-and-mul) or a plain row quantizer; and the product over the
per-token and per-output-channel scales (`scaled_mm`).

Each quantizer holds one token's row in registers (one program per row, one read of its input),
takes the row's amax, and stores q = e4m3(clamp(y * (1 / scale), -448, 448)) with
scale = max(amax, 1e-12) * float32(1 / 448) ([T, 1]): the 16-bit row y is never written. Its bits are
those of `quantize_rows_reference` (`infer.kernels.fp8_reference`) over the output of the matching
16-bit kernel of `infer.kernels.layers`: y is computed and rounded to the activation dtype as that
kernel does, 1 / scale is an IEEE division (`div_rn`, as torch divides; Triton's `/` is not) and the
e4m3 rounding is `infer.kernels.e4m3`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.e4m3 import quantize
from infer.kernels.fp8_reference import FP8, FP8_MAX_INV, SCALE_MIN, scaled_mm_reference
from infer.kernels.layers import act_and_mul, add_norm
from infer.kernels.triton_pdl import kernel_args, wait_and_release

__all__ = ["quantize_rows", "rms_norm_fp8", "silu_and_mul_fp8", "gelu_and_mul_fp8", "scaled_mm"]

_FP8_MAX_INV = tl.constexpr(FP8_MAX_INV)
_SCALE_MIN = tl.constexpr(SCALE_MIN)
FEW_ROWS = 64  # fewer rows than this take more warps a row (`_warps`)


@triton.jit
def _store_quantized(y, q_ptr, scale_ptr, cols, mask):
    """One row y (float32, 0 in masked columns) stored as e4m3 at q_ptr, its scale at scale_ptr."""
    amax = tl.max(tl.abs(y), axis=0)
    scale = tl.maximum(amax, _SCALE_MIN) * _FP8_MAX_INV
    tl.store(scale_ptr, scale)
    tl.store(q_ptr + cols, quantize(y, tl.math.div_rn(1.0, scale), q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    _store_quantized(x, q_ptr + row * K, scale_ptr + row, cols, mask)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    q_ptr,
    scale_ptr,
    res_out_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    y = add_norm(x, res_ptr + row * N, w_ptr, res_out_ptr + row * N, eps, cols, mask, N, HAS_RESIDUAL)
    _store_quantized(y.to(tl.float32), q_ptr + row * N, scale_ptr + row, cols, mask)


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, N: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    _store_quantized(act_and_mul(gate, up, GELU).to(tl.float32), q_ptr + row * N, scale_ptr + row, cols, mask)


def _warps(rows: int, block: int) -> int:
    """Warps of each program (one a row of `block` columns): 16, except 4 for rows of at most 4096
    columns when there are enough rows to fill the GPU. A few rows leave most SMs idle and each row's
    time is its own program's instructions, which more warps share; SiLU-and-mul's wide rows take 16
    at any count (measured: docs/performance.md, "FP8 activations (W8A8)")."""
    return 16 if rows < FEW_ROWS or block > 4096 else 4


def _outputs(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(rows, k, dtype=FP8, device=device), torch.empty(rows, 1, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, K] bf16/fp16/fp32 -> q: [T, K] float8_e4m3fn, scale: [T, 1] float32 (x ~ q * scale)
    x = x.contiguous()
    rows, k = x.shape
    q, scale = _outputs(rows, k, x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(rows,)](
            x, q, scale, K=k, BLOCK=block, num_warps=_warps(rows, block), **kernel_args(x.device)
        )
    return q, scale


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    # x: [T, N]; quantize_rows(rms_norm(x, weight, eps, residual)) in one kernel: (q, scale), and with a
    # residual ((q, scale), x + residual)
    x = x.contiguous()
    rows, n = x.shape
    q, scale = _outputs(rows, n, x.device)
    res_out = torch.empty_like(x) if residual is not None else x  # without a residual: its dtype only
    block = triton.next_power_of_2(n)
    if rows:
        _rms_norm_fp8_kernel[(rows,)](
            x,
            residual.contiguous() if residual is not None else x,
            weight,
            q,
            scale,
            res_out,
            eps,
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=_warps(rows, block),
            **kernel_args(x.device),
        )
    return (q, scale) if residual is None else ((q, scale), res_out)


def _act_and_mul_fp8(h: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    h = h.contiguous()
    rows, n = h.shape[0], h.shape[1] // 2
    q, scale = _outputs(rows, n, h.device)
    block = triton.next_power_of_2(n)
    if rows:
        _act_and_mul_fp8_kernel[(rows,)](
            h, q, scale, N=n, BLOCK=block, GELU=gelu, num_warps=_warps(rows, block), **kernel_args(h.device)
        )
    return q, scale


def silu_and_mul_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # h: [T, 2I] (gate then up) -> quantize_rows(silu(gate) * up): q [T, I], scale [T, 1]
    return _act_and_mul_fp8(h, gelu=False)


def gelu_and_mul_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # h: [T, 2I] (gate then up) -> quantize_rows(gelu_tanh(gate) * up): q [T, I], scale [T, 1]
    return _act_and_mul_fp8(h, gelu=True)


def scaled_mm(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(q * x_scale) @ (weight_fp8 * weight_scale[:, None]).T (+ bias) in `out_dtype`: [T, N].

    q: [T, K] e4m3 and x_scale: [T, 1] float32, as the quantizers give them; weight_fp8: [N, K] e4m3,
    contiguous; weight_scale: [N] float32; bias: [N] in out_dtype (bfloat16, float16 or float32).
    On CUDA, torch._scaled_mm with row-wise scales (an FP8 GPU: compute capability 8.9 or newer),
    accumulating in float32; it needs K and N multiples of 16 (a layer pads its weight once, when it
    loads it) and adds a float32 bias itself. Elsewhere, `scaled_mm_reference` (float32)."""
    if bias is not None and bias.dtype != out_dtype:
        raise ValueError(f"the bias of an FP8 matrix product is in its output dtype {out_dtype}, not {bias.dtype}")
    if q.device.type != "cuda":
        return scaled_mm_reference(q, x_scale, weight_fp8, weight_scale, out_dtype, bias)
    (rows, k), n = q.shape, weight_fp8.shape[0]
    if k % 16 or n % 16:
        raise ValueError(
            f"an FP8 matrix product on the GPU needs K and N multiples of 16, not K={k}, N={n}: "
            "pad the weight (and its scales) with zeros to the next multiple of 16 when loading it"
        )
    if rows == 0:
        return torch.empty(0, n, dtype=out_dtype, device=q.device)
    float_bias = bias is not None and out_dtype == torch.float32  # torch takes a 16-bit bias only
    y = torch._scaled_mm(
        q.contiguous(),
        weight_fp8.t(),
        scale_a=x_scale.contiguous(),
        scale_b=weight_scale.view(1, -1),
        bias=None if float_bias else bias,
        out_dtype=out_dtype,
    )
    return y.add_(bias) if float_bias else y
