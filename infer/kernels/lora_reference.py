"""Batched LoRA in torch: the CPU's path, and the reference of the Triton kernels (`infer.kernels.lora`)."""

from __future__ import annotations

import torch


def lora_reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: list[tuple[int, int, int]]
) -> torch.Tensor:
    """y[start:end] += (x[start:end] A_s^T) B_s^T for each (slot, start, end), in x's dtype; returns y."""
    for slot, start, end in segments:
        y[start:end] += (x[start:end] @ a[slot].t()) @ b[slot].t()
    return y
