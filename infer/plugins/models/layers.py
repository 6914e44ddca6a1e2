"""Model layers in plain torch, registered through the layers hook so a plugin can swap in fused ones."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.core.hookspecs import hookimpl
from infer.core.interfaces import Capabilities, Layers

class RMSNorm(nn.Module):
    capabilities = Capabilities(priority=0)
    # weight * x / rms(x) with `weight` and `eps` as here: a tensor-parallel all-reduce may compute it
    # in its own kernel (ParallelState.reduce_add_norm). A subclass that changes the formula sets False.
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


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}: supported are default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as HF Llama applies it."""

    capabilities = Capabilities(priority=0)

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

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


class Linear(nn.Linear):
    capabilities = Capabilities(priority=0)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    @staticmethod
    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ weight [out, in].T: what tensor-parallel projections holding a shard call."""
        return F.linear(x, weight)


def default_layers() -> Layers:
    return Layers(rms_norm=RMSNorm, rotary_embedding=RotaryEmbedding, silu_and_mul=SiluAndMul, linear=Linear)


@hookimpl
def infer_register_layers(register) -> None:
    register("rms_norm", RMSNorm)
    register("rotary_embedding", RotaryEmbedding)
    register("silu_and_mul", SiluAndMul)
    register("linear", Linear)
