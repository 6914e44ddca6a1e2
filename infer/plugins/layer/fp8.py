"""FP8 weights (`--quantization fp8`): linear layers holding e4m3 weights and a float32 scale per output row.

A weight W is stored as Q = round(W / s) with s = max |W[n, :]| / 448 for each output row n, so W[n] ~ Q[n] *
s[n]. A checkpoint in the model's dtype is quantized so as it loads, row by row (a row's scale depends on it
alone, so q, k and v or gate and up fill their rows of the fused projections one after another); an FP8
checkpoint's values and scales load as they are (a per-tensor scale repeated over the tensor's rows).

The product quantizes x too, per row (per token): y = (Qx @ Q.T) * sx * s (W8A8), in every step, so a
token's products do not depend on how many rows share its step (in this module they are exact; on CUDA
the GEMV and the FP8 GEMM may differ in a sum's last bits). What comes before a product still may:
attention sums in another order in decode and in verification, and e4m3 rounding can amplify that. On CUDA a one-row step streams the weights
through a GEMV; more rows go to FP8 tensor cores at twice bf16's rate, each half bf16's weight bytes.
This module is the reference, in plain torch on any device (float32 products of the dequantized values);
`infer.plugins.layer.fp8_fused` runs the same math in FP8 kernels on CUDA. The LM head keeps the model's dtype.
Under tensor parallelism each projection is this class at one rank's shape (`quantized_shard` in
infer.distributed.layers): a row-parallel one keeps every full row's weight scale (its e4m3 values are tp
= 1's) and quantizes its own columns of x per row, as vLLM's shards do: no collective before the product,
and each partial sum has the finer scale of its rank's columns, so tp > 1 sums differently rounded
activations than tp = 1 (within e4m3's rounding, not bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.api import Capabilities
from infer.api.hookspecs import hookimpl
from infer.kernels.fp8_reference import FP8, FP8_MAX_INV, quantize_rows_reference, to_e4m3


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """Float32 [N]: each row's amax / 448 of w [N, K] (1 for a row of zeros)."""
    amax = w.float().abs().amax(dim=1)
    return torch.where(amax > 0, amax * FP8_MAX_INV, torch.ones_like(amax))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, s): e4m3 values [N, K] and float32 scales [N] with Q * s[:, None] ~ w, s = `weight_scales(w)`;
    Q = w * (1 / s) in float32, rounded to nearest. The same bits on any device."""
    w = w.float()
    scale = weight_scales(w)
    return to_e4m3(w, scale[:, None]), scale


class Fp8Linear(nn.Module):
    quantization = "fp8"
    capabilities = Capabilities(priority=0)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the e4m3 products have 8 significant bits and their sums fit float64's 53 exactly, whatever the
        # order: a row's result does not depend on the rows beside it (or on the BLAS), then both scales
        q, scale = quantize_rows_reference(x)
        sums = F.linear(q.double(), self.weight.double())
        y = (sums * scale.double() * self.weight_scale.double()).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load_rows(self, name: str, offset: int, size: int, tensor: torch.Tensor) -> list[str]:
        """Rows [offset, offset + size) of `name` from a checkpoint tensor: `weight` in the model's dtype
        (quantized here, filling its scales too) or in FP8; `weight_scale` of an FP8 checkpoint (per row,
        [size] or [size, 1], or one for the tensor); `bias`. A static `input_scale` is not read."""
        rows = slice(offset, offset + size)
        if name == "weight" and tensor.dtype != FP8:
            q, scale = quantize_weight(tensor.to(self.weight.device))
            self.weight[rows].copy_(q)
            self.weight_scale[rows].copy_(scale)
            return ["weight", "weight_scale"]
        if name == "weight_scale":
            self.weight_scale[rows].copy_(tensor.float().reshape(-1).expand(size))
            return ["weight_scale"]
        if name == "weight":  # an FP8 checkpoint's, as it is
            self.weight[rows].copy_(tensor)
            return ["weight"]
        if name == "bias" and self.bias is not None:
            self.bias[rows].copy_(tensor)
            return ["bias"]
        return []

    @torch.no_grad()
    def load_columns(self, name: str, start: int, tensor: torch.Tensor) -> list[str]:
        """Columns [start, start + in_features) of the whole checkpoint tensor `name` (a row-parallel shard's):
        a weight in the model's dtype is quantized whole, row by row, so the scales (each full row's) are
        tp = 1's; an FP8 checkpoint's values are sliced and its `weight_scale` is taken whole."""
        if name != "weight":
            return self.load_rows(name, 0, self.out_features, tensor)
        filled = ["weight"]
        if tensor.dtype != FP8:
            tensor, scale = quantize_weight(tensor.to(self.weight.device))
            self.weight_scale.copy_(scale)
            filled.append("weight_scale")
        self.weight.copy_(tensor[:, start : start + self.in_features])
        return filled


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """An activation a kernel has already quantized per row for the FP8 product after it."""

    q: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the activation dtype it stands for (the product's output dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@hookimpl
def infer_register_layers(register) -> None:
    register("linear", Fp8Linear)
