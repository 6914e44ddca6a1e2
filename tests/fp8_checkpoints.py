"""FP8 checkpoints the way quantizers store them, for the tests that load one (tests/ is on sys.path)."""

from __future__ import annotations

import torch

from infer.plugins.layers.fp8 import FP8, quantize_weight

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(name: str) -> bool:
    """Whether the checkpoint tensor `name` (`...q_proj.weight`) is a decoder projection's weight."""
    return name.split(".")[-2] in PROJECTIONS


def stored(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale) of `w` as a checkpoint holds them: one scale per tensor ([1], the `fp8`
    layout) or one per output channel ([N, 1], compressed-tensors)."""
    if per_tensor:
        scale = (w.abs().amax() / 448).reshape(1)
        return (w * (1 / scale)).clamp(-448, 448).to(FP8), scale
    q, scale = quantize_weight(w)
    return q, scale[:, None]
