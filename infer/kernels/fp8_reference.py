"""FP8 (e4m3) activations for W8A8 matrix products, in plain torch: the references the Triton
quantizers of `infer.kernels.fp8` are tested against, and what runs where there is no Triton.

Per token (row) x of a [T, K] activation: scale = max(amax(|x|), 1e-12) / 448 in float32, and
q = e4m3(clamp(x * (1 / scale), -448, 448)), rounded to nearest (ties to even) as
`infer.runtime.kv_cache.quantize_fp8` rounds. x is about q * scale: within 2^-4 of |x| where
|q| >= 2^-6 (e4m3's normals), within scale * 2^-10 below that (its subnormals). A weight [N, K] is
stored as e4m3 with a float32 scale per output channel (row), and the product is
(q * x_scale) @ (w * w_scale[:, None]).T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "FP8",
    "FP8_MAX",
    "FP8_MAX_INV",
    "SCALE_MIN",
    "to_e4m3",
    "quantize_rows_reference",
    "rms_norm_fp8_reference",
    "silu_and_mul_fp8_reference",
    "scaled_mm_reference",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest value; it has no infinity
# x / 448 is taken as x * float32(1 / 448), as torch divides by a constant on CUDA (on the CPU it divides),
# so that a scale has the same bits on every device; 1 / scale is an IEEE division everywhere
FP8_MAX_INV = 1.0 / FP8_MAX
SCALE_MIN = 1e-12  # the smallest row amax a scale is taken from: a row of zeros gets 1e-12 / 448, not 0


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 / scale) in float32, clamped to +-448 and rounded to the nearest e4m3 (`scale` broadcasts)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, K] -> q: [T, K] float8_e4m3fn, scale: [T, 1] float32
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=SCALE_MIN) * FP8_MAX_INV
    return to_e4m3(xf, scale), scale


def rms_norm_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    # x: [T, H]; RMSNorm(x + residual) * weight as the eager layer computes it, quantized per row;
    # with a residual returns ((q, scale), x + residual)
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    quantized = quantize_rows_reference(weight * h.to(x.dtype))
    return quantized if residual is None else (quantized, residual)


def silu_and_mul_fp8_reference(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # h: [T, 2I] (gate then up) -> silu(gate) * up [T, I], quantized per row
    gate, up = h.chunk(2, dim=-1)
    return quantize_rows_reference(F.silu(gate) * up)


def scaled_mm_reference(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [T, K] e4m3, x_scale: [T, 1] float32, weight_fp8: [N, K] e4m3, weight_scale: [N] float32,
    # bias: [N] -> [T, N] in out_dtype, dequantized and multiplied in float32
    y = (q.float() * x_scale) @ (weight_fp8.float() * weight_scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
