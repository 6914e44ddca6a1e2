"""A layers plugin: the `rms_norm` layer kind, on torch's own `F.rms_norm`.

The layers hook lets a plugin swap a layer into every model without touching model code: a model
builds each norm as `layers.rms_norm(hidden_size, eps)` and calls it as `norm(x)` or, adding the
residual first, `norm(x, residual)` -> (normed, x + residual). Where several implementations of a
kind are installed, the highest `capabilities.priority` runnable on the device wins: this one's 1
beats the built-in torch layers' 0, and loses to the fused Triton kernels' 10 on a GPU. The other
kinds (rotary embedding, activations, linear) stay the built-in ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import infer

INFER_PLUGIN_API = ">=2,<3"


class RMSNorm(nn.Module):
    capabilities = infer.Capabilities(devices=frozenset({"cpu", "cuda"}), priority=1)
    # weight * x / rms(x) with `weight` and `eps` as named here: a tensor-parallel all-reduce may
    # compute it in a kernel of its own, fused with the sum
    plain_rms_norm = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # the checkpoint's `...norm.weight`
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = x + residual
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)  # in float32, as HF
        out = self.weight * normed
        return out if residual is None else (out, residual)


@infer.hookimpl
def infer_register_layers(register) -> None:
    register("rms_norm", RMSNorm)
