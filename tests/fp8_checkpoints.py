"""FP8 checkpoints the way quantizers store them, for the tests that load one (tests/ is on sys.path)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from infer.plugins.layer.fp8 import FP8, quantize_weight

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


def with_kv_scales(source: Path, folder: Path, scales: list[tuple[float, float]]) -> Path:
    """`source` (a one-file checkpoint) copied to `folder` (made here) with each layer's (k_scale, v_scale)
    beside its weights, as llm-compressor's kv_cache_scheme stores them."""
    folder.mkdir()
    for f in source.iterdir():
        shutil.copy(f, folder / f.name)
    tensors = load_file(str(source / "model.safetensors"))
    for layer, (k, v) in enumerate(scales):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
