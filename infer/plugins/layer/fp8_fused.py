"""FP8 weights in kernels on CUDA (priority 10 over the plain-torch `infer.plugins.layer.fp8`)."""

from __future__ import annotations

import torch

from infer.api import Capabilities
from infer.api.errors import ModelLoadError
from infer.api.hookspecs import hookimpl
from infer.plugins.layer.fp8 import Fp8Linear, QuantizedRows
from infer.plugins.layer.fused import triton_reason


def _reason() -> str | None:
    """Why the FP8 kernels cannot run here: no Triton, or a GPU without FP8 tensor cores (before 8.9)."""
    reason = triton_reason()
    if reason is None and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        reason = f"FP8 tensor cores need compute capability 8.9 or newer (Ada, Hopper), this GPU has {major}.{minor}"
    return reason


CAPS = Capabilities(devices=frozenset({"cuda"}), priority=10, available=_reason)


class FusedFp8Linear(Fp8Linear):
    """`Fp8Linear` in kernels, on CUDA. Its input comes quantized per row: by the norm before it
    (`FusedRMSNorm.quantize_output`, set where `takes_quantized_input`), by the kernel that applies the
    MLP's activation (`gated`: SiLU-and-mul of gate | up), or else by one quantizing kernel. One row goes
    through the weight-streaming GEMV (e4m3 x and weights, both scales in its epilogue; fp32 sums, or
    f16 sums of 16 products first where the tuner picks `infer.kernels.gemv_e4m3`); more
    through torch._scaled_mm with row-wise scales (Hopper's FP8 tensor cores keep fewer bits than fp32 in
    their partial sums, so a row's bits may differ between the two)."""

    capabilities = CAPS
    fuses_activation = "silu_and_mul"  # the MLP activation `gated` applies (transformer.MLP reads it)
    takes_quantized_input = True  # a norm before it may hand it `QuantizedRows`

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        if in_features % 16 or out_features % 16:  # torch._scaled_mm's FP8 GEMM takes multiples of 16
            raise ModelLoadError(
                f"an FP8 projection of {in_features} -> {out_features} features does not run in the FP8 GEMM, "
                f"which takes multiples of 16: drop --quantization fp8 (or use another --tp for a shard)"
            )
        super().__init__(in_features, out_features, bias)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self.quantized(x)
        from infer.kernels.fp8 import quantize_rows

        return self.quantized(QuantizedRows(*quantize_rows(x), x.dtype))

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """self(SiLU(gate) * up) for h = [gate | up] ([T, 2 * in_features]), quantized as it is made."""
        from infer.kernels.fp8 import silu_and_mul_fp8

        return self.quantized(QuantizedRows(*silu_and_mul_fp8(h), h.dtype))

    def quantized(self, x: QuantizedRows) -> torch.Tensor:
        """The product for x already quantized per row, in x.dtype."""
        if x.shape[0] == 1:
            from infer.kernels.gemv import gemv

            y = gemv(x.q, self.weight, scale=self.weight_scale, x_scale=x.scale, out_dtype=x.dtype)
            return y if self.bias is None else y + self.bias
        from infer.kernels.fp8 import scaled_mm

        return scaled_mm(x.q, x.scale, self.weight, self.weight_scale, x.dtype, self.bias)


@hookimpl
def infer_register_layers(register) -> None:
    register("linear", FusedFp8Linear)
