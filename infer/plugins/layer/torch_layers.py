"""Model layers in plain torch, registered through the layers hook so a plugin can swap in fused ones."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.api import Capabilities, Layers
from infer.api.hookspecs import hookimpl
from infer.api.rope import Rope


class RMSNorm(nn.Module):
    capabilities = Capabilities(priority=0)
    # weight * x / rms(x) with `weight` and `eps` as here: a tensor-parallel all-reduce may compute it
    # in its own kernel (infer.distributed.layers.reduce_add_norm). A subclass that changes the formula sets False.
    plain_rms_norm = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        # x: [T, hidden]. With a residual, returns (normed(x + residual), x + residual).
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as HF Llama applies it, from the model's `Rope`
    (transformers' frequencies and attention scaling). Its `cos` and `sin` tables ([max_position,
    head_dim / 2] float32, scaled) are the whole contract: fused kernels apply the same tables."""

    capabilities = Capabilities(priority=0)

    def __init__(self, rope: Rope, max_position: int) -> None:
        super().__init__()
        cos, sin = rope.tables(max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SiluAndMul(nn.Module):
    capabilities = Capabilities(priority=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate then up) -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    capabilities = Capabilities(priority=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate then up) -> [T, I]; GELU's tanh approximation (HF's gelu_pytorch_tanh)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Linear(nn.Linear):
    capabilities = Capabilities(priority=0)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    @staticmethod
    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ weight [out, in].T: what tensor-parallel projections holding a shard call."""
        return F.linear(x, weight)


def default_layers() -> Layers:
    return Layers(
        rms_norm=RMSNorm,
        rotary_embedding=RotaryEmbedding,
        silu_and_mul=SiluAndMul,
        linear=Linear,
        gelu_and_mul=GeluAndMul,
    )


@hookimpl
def infer_register_layers(register) -> None:
    register("rms_norm", RMSNorm)
    register("rotary_embedding", RotaryEmbedding)
    register("silu_and_mul", SiluAndMul)
    register("linear", Linear)
    register("gelu_and_mul", GeluAndMul)
