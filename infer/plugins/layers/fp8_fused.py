"""FP8 weights in kernels on CUDA (priority 10 over the plain-torch `infer.plugins.layers.fp8`)."""

from __future__ import annotations

import torch

from infer.core.hookspecs import hookimpl
from infer.plugins.layers.fp8 import WEIGHT_ONLY_ROWS, Fp8Linear, QuantizedRows
from infer.plugins.layers.fused import CAPS


class FusedFp8Linear(Fp8Linear):
    """`Fp8Linear` in kernels, on CUDA: up to WEIGHT_ONLY_ROWS rows the weight-streaming GEMV reads the
    e4m3 weights and applies the row scales in its epilogue; more rows are quantized per token by one
    kernel and multiplied by cuBLAS's FP8 GEMM over both scales. As the MLP's down projection it also
    takes the activation's input (`gated`): SiLU-and-mul applied as the GEMV reads it, or by the kernel
    that quantizes it, so the 16-bit activation is never written."""

    capabilities = CAPS
    fuses_activation = "silu_and_mul"  # the MLP activation `gated` applies (transformer.MLP reads it)
    quantized_input_above = WEIGHT_ONLY_ROWS  # more rows than this may come quantized (`QuantizedRows`)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):  # quantized by the norm before (`FusedRMSNorm.quantize_above`)
            return self.quantized(x.q, x.scale, x.dtype)
        if x.shape[0] <= WEIGHT_ONLY_ROWS:
            from infer.kernels.gemv import gemv

            return self._biased(gemv(x, self.weight, scale=self.weight_scale))
        from infer.kernels.fp8 import quantize_rows as quantize

        return self.quantized(*quantize(x), x.dtype)

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """self(SiLU(gate) * up) for h = [gate | up] ([T, 2 * in_features])."""
        if h.shape[0] <= WEIGHT_ONLY_ROWS:
            from infer.kernels.gemv import gemv_silu_mul

            return self._biased(gemv_silu_mul(h, self.weight, scale=self.weight_scale))
        from infer.kernels.fp8 import silu_and_mul_fp8

        return self.quantized(*silu_and_mul_fp8(h), h.dtype)

    def quantized(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The product for x already quantized per row (q [T, K] e4m3, scale [T, 1]), in `dtype`."""
        from infer.kernels.fp8 import scaled_mm

        return scaled_mm(q, scale, self.weight, self.weight_scale, dtype, self.bias)

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


@hookimpl
def infer_register_layers(register) -> None:
    register("linear", FusedFp8Linear)
