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


def segments_of(slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each run of consecutive rows of one slot (-1's rows left out): `lora_reference`'s
    segments from each row's slot."""
    found: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if s < 0:
            continue
        if found and found[-1][0] == s and found[-1][2] == i:
            found[-1] = (s, found[-1][1], i + 1)
        else:
            found.append((s, i, i + 1))
    return found
