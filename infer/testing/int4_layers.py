"""Random 4-bit layers in `Int4Linear`'s form and their dequantized product, for the int4 kernels' tests."""

from __future__ import annotations

import torch

from infer.kernels.int4_reference import pack_nibbles, quantize_rtn, unpack_nibbles


def random_int4_layer(
    n: int, k: int, group: int, symmetric: bool, act_order: bool, device: str, seed: int = 0
) -> tuple[list[torch.Tensor], int]:
    """([qweight uint8 [n, k/2], scales [n, G], zeros [n, G], g_idx [k]], the group's width) of a random
    weight rounded to nearest in groups of `group` columns (-1: one a row); with `act_order`, the
    columns' groups scattered as GPTQ's act-order stores them, each still that wide."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, s, z = quantize_rtn(w, group, symmetric)
    width = k if group == -1 else group
    g_idx = torch.arange(k, dtype=torch.int32) // width
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
        cols = g_idx.long()
        q = torch.clamp(torch.round(w / s[:, cols]) + z[:, cols].float(), 0, 15).to(torch.uint8)
    return [t.to(device) for t in (pack_nibbles(q), s, z, g_idx)], width


def dequantized_product(
    x: torch.Tensor,
    qweight: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ W.T (+ bias) in float32, W = (q - z) * s dequantized in float32."""
    cols = g_idx.long()
    w = (unpack_nibbles(qweight).float() - z.float()[:, cols]) * s[:, cols]
    y = x.float() @ w.T
    return y if bias is None else y + bias.float()
