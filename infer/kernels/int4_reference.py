"""4-bit weights' packings and rounding in plain torch: the layouts GPTQ, AWQ and compressed-tensors store,
the one `infer.plugins.layer.int4` keeps (two values a byte), and round to nearest in groups (GPTQ's grid).
The reference every int4 kernel and checkpoint writer is checked against."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs column 8j + AWQ_ORDER[i] into nibble i of int32 j


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The 4-bit values of int32 words packed along `dim` (nibble i of a word is value 8j + i, or 8j +
    order[i]), as int16 with `dim` 8x longer."""
    words = packed.to(torch.int32).movedim(dim, -1)
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., W, 8]
    if order is not None:
        nibbles = nibbles[..., [order.index(c) for c in range(8)]]
    return nibbles.flatten(-2).to(torch.int16).movedim(-1, dim)


def pack_int32(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32`: values in [0, 15], `dim` a multiple of 8 long."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32).movedim(-1, dim)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> uint8 [N, K/2], column 2j in the low nibble."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def group_grid(
    groups: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of each group of `groups` [..., g] (float32, zero in 0..15): GPTQ's grid. Symmetric keeps
    zero 8 and s = 2 amax / 15; asymmetric spans [min, max] (each widened to include 0). The scale is rounded
    to `scale_dtype` (what a checkpoint stores) before the zero is chosen."""
    lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
    zero = torch.full_like(scale, 8.0) if symmetric else torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(w / s) + z, 0, 15), float32 (broadcast shapes)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 15)


def quantize_rtn(
    w: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest in groups of `group_size` columns (-1: a row): (q [N, K] 0..15, scales [N, G] float32,
    zeros [N, G] 0..15) with w ~ (q - z) * s, on `group_grid`'s grid."""
    w = w.float()
    n, k = w.shape
    g = k if group_size == -1 else group_size
    groups = w.reshape(n, k // g, g)
    scale, zero = group_grid(groups, symmetric, scale_dtype)
    q = round_to_grid(groups, scale[..., None], zero[..., None])
    return q.reshape(n, k).to(torch.uint8), scale, zero.to(torch.uint8)
