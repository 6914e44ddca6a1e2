"""Checks a model plugin runs on checkpoint tensors as it loads them: a shape its config.json implies,
and no FP8 tensor cast into a layer the run does not quantize. Each refusal names the fix."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infer.api.errors import ModelLoadError

__all__ = ["check_shape", "check_unscaled"]


def check_shape(name: str, shape: Sequence[int], expected: Sequence[int] | None, where: str = "the checkpoint") -> None:
    """Refuse a checkpoint tensor whose shape is not the one the model's config implies (None: unused)."""
    if expected is not None and tuple(shape) != tuple(expected):
        raise ModelLoadError(
            f"tensor {name} in {where} has shape {list(shape)} but config.json implies {list(expected)}: the weights "
            f"and config.json disagree (hidden_size, intermediate_size, heads, head_dim or vocab_size); "
            f"use the config.json saved with these weights"
        )


def check_unscaled(name: str, tensor: Any, param: torch.Tensor) -> Any:
    """Refuse an FP8 checkpoint tensor bound for a parameter that is not FP8 (a layer the run does not
    quantize): cast without its scale it would be wrong. `tensor`: a tensor or a safetensors slice."""
    dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else str(tensor.get_dtype())
    if dtype in (torch.float8_e4m3fn, "F8_E4M3") and param.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(
            f"tensor {name} is stored in FP8 but the layer it fills is not quantized here (the LM head, or a "
            f"draft model run unquantized): use a checkpoint that keeps it in bf16, or pass --quantization fp8"
        )
    return tensor
