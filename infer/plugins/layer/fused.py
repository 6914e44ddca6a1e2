"""Fused model layers in Triton, swapped in through the layers hook on CUDA (priority 10).

Each replaces several eager kernels with one: RMSNorm with the residual add (add, square, mean,
rsqrt, scale: 1 read of x and residual, 1 write of each), rotary embedding applied to q and k in
place of ten elementwise ops, SiLU-and-mul and GELU-and-mul, and a linear layer whose one-token case (batch-1
decode) is a Triton matrix-vector product streaming the weights (more tokens go to cuBLAS). For
one token the MLP's SiLU-and-mul is read inside its down projection's GEMV (`FusedSiluAndMul.down`). On
the CPU the plain torch layers are used; the kernels also run there under TRITON_INTERPRET=1,
which is how CI tests them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer.api import Capabilities, LinearMatmul, pushing
from infer.api.hookspecs import hookimpl
from infer.common import env
from infer.plugins.layer import torch_layers as plain


def triton_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install 'infer[triton]'"
    if not torch.cuda.is_available() and not env.triton_interpret():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return None


CAPS = Capabilities(devices=frozenset({"cuda"}), priority=10, available=triton_reason)


class FusedRMSNorm(plain.RMSNorm):
    capabilities = CAPS
    # set by a model whose projection after this norm takes FP8 input (`FusedFp8Linear`): the norm
    # stores its output quantized per row (`QuantizedRows`), in the same kernel
    quantize_output = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.quantize_output:
            return self._quantized(x, residual)
        from infer.kernels.layers import rms_norm

        return rms_norm(x, self.weight, self.eps, residual)

    def _quantized(self, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
        from infer.kernels.fp8 import rms_norm_fp8
        from infer.plugins.layer.fp8 import QuantizedRows

        out = rms_norm_fp8(x, self.weight, self.eps, residual)
        if residual is None:
            return QuantizedRows(*out, x.dtype)
        return QuantizedRows(*out[0], x.dtype), out[1]


class FusedRotaryEmbedding(plain.RotaryEmbedding):
    capabilities = CAPS
    # its Neox-style cos/sin tables ([max_position, D/2] float32) may be applied by an attention
    # backend that rotates q and k in its cache write (`forward_with_rotary`), one kernel fewer
    fuses_into_attention = True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from infer.kernels.layers import rotary

        half = self.cos.shape[-1]
        if half & (half - 1):  # the kernel's tiles are powers of two: Phi-3's head_dim 96 rotates in torch
            return super().forward(positions, q, k)
        return rotary(positions, q, k, self.cos, self.sin)


class FusedSiluAndMul(nn.Module):
    capabilities = CAPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from infer.kernels.layers import silu_and_mul

        return silu_and_mul(x)

    @staticmethod
    def fuses_with(projection: nn.Module) -> bool:
        """Whether `projection` (the MLP's down projection: a linear layer, or a tensor-parallel shard
        whose output is summed elsewhere) is `FusedLinear`'s plain matmul, which `down` may replace."""
        return (
            isinstance(projection, LinearMatmul)
            and projection.matmul is FusedLinear.matmul
            # a down projection is any module: a bias, and a tensor-parallel shard's `reduce`, are optional
            and getattr(projection, "bias", None) is None
            and not getattr(projection, "reduce", False)  # only a row-parallel shard has `reduce`
        )

    @pushing
    def down(self, h: torch.Tensor, weight: torch.Tensor, push: Any = None) -> torch.Tensor:
        """matmul(self(h), weight); for a few rows one GEMV that applies SiLU-and-mul as it reads h."""
        from infer.kernels.gemv import gemv_silu_mul, takes_rows

        if takes_rows(h, weight, push):
            return gemv_silu_mul(h, weight, push=push)
        return FusedLinear.matmul(self(h), weight, push=push)


class FusedGeluAndMul(nn.Module):
    capabilities = CAPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from infer.kernels.layers import gelu_and_mul

        return gelu_and_mul(x)


@pushing
def _matmul(x: torch.Tensor, weight: torch.Tensor, push: Any = None) -> torch.Tensor:
    """x @ weight.T; one token through the Triton GEMV, which can push a tensor-parallel partial sum
    into the ranks' exchange (`push`, a `infer.distributed.all_reduce.lamport.PushTarget`: one-token steps
    only); up to 8 rows (a verify step of speculative decoding, a small batch) too, where the GEMV has
    a tile for their count (`gemv.takes_rows`: the row counts of the CUDA graphs' buckets), else cuBLAS."""
    from infer.kernels.gemv import gemv, takes_rows

    if takes_rows(x, weight, push):
        return gemv(x, weight, push=push)
    if push is not None:
        raise ValueError(f"a pushed partial sum is one token's, got {tuple(x.shape)}")
    return torch.nn.functional.linear(x, weight)


class FusedLinear(plain.Linear):
    capabilities = CAPS
    matmul = staticmethod(_matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight) if self.bias is None else super().forward(x)


@hookimpl
def infer_register_layers(register) -> None:
    register("rms_norm", FusedRMSNorm)
    register("rotary_embedding", FusedRotaryEmbedding)
    register("silu_and_mul", FusedSiluAndMul)
    register("linear", FusedLinear)
    register("gelu_and_mul", FusedGeluAndMul)
