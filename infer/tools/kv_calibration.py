"""FP8 KV-cache scales from calibration text: each decoder layer's largest value and key on their way to
its cache, as `infer models quantize` (gptq) records them while it runs the text through the model layer
by layer (`infer.tools.quantize.layer_hessians`), and the k_scale / v_scale it writes beside the layer's weights
as llm-compressor writes them (`model.layers.N.self_attn.k_scale` / `v_scale`, and a `kv_cache_scheme` in
the config), which `--kv-cache-dtype fp8` reads the cache with (`infer.loading.kv_scales`): the largest
|value| and |key| over e4m3's 448.

A key is taken after its rotary embedding, which turns each pair of its dimensions by the token's angle
(and scales it by yarn's or longrope's attention factor): the pair's length, so scaled, bounds both
rotated values and is what counts (at most sqrt(2) over the largest rotated value, never under it). Only
for the attention layouts these hooks are checked against (Llama, Mistral, Qwen 2 and 3, Gemma 2, Phi-3:
`MODEL_TYPES`); another model's folder gets none, and says so.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from infer.kernels.fp8_reference import FP8_MAX
from infer.loading.config import kv_layout

# what a folder with calibrated KV-cache scales adds to its quantization_config: one static scale a tensor
KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}
# the model types whose attention `observe` reads as their cache holds it (tests/test_quantize.py)
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"})


def rotary_scaling(model: torch.nn.Module) -> float:
    """The factor the model's rotary embedding multiplies cos and sin by (yarn's and longrope's
    attention scaling; 1 for the others)."""
    # duck-typed HF modules: a rotary embedding of transformers carries attention_scaling, no other module does
    found = [m.attention_scaling for m in model.modules() if isinstance(getattr(m, "attention_scaling", None), float)]
    return max(found, default=1.0)


def observe(layer: torch.nn.Module, config: Any, amax: list[float], scaling: float = 1.0) -> list[Any]:
    """Hooks that raise `amax` [key, value] to the largest |value| and rotary-pair length of key (times
    `scaling`, the rotary's attention factor; see the module's docstring) that `layer`'s attention puts in
    its cache: from k_norm's output where the attention normalizes its keys, else k_proj's, and v_proj's
    (or the k and v parts of a fused qkv_proj's output). None for an attention laid out otherwise (that
    layer gets no scales)."""
    attention = getattr(layer, "self_attn", None)  # an HF decoder layer: its attention's name varies by family
    if attention is None:
        return []
    heads = config.num_attention_heads
    kv_heads, head_dim = kv_layout(config)
    # an HF config: transformers moved partial_rotary_factor into rope_parameters; older ones keep it on top
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0  # absent from most families' configs
    rotary = int(head_dim * factor) // 2 * 2

    def keys(k: torch.Tensor) -> None:
        k = k.detach().reshape(-1, head_dim).float()
        half = rotary // 2
        lengths = torch.sqrt(k[:, :half] ** 2 + k[:, half:rotary] ** 2) * scaling
        rest = k[:, rotary:].abs().max().item() if rotary < head_dim else 0.0
        raise_to(0, lengths.max().item())
        raise_to(0, rest)

    def values(v: torch.Tensor) -> None:
        raise_to(1, v.detach().abs().max().item())

    def raise_to(which: int, value: float) -> None:  # a NaN sticks (max() would drop it)
        if math.isnan(value) or value > amax[which]:
            amax[which] = value

    def output(fn: Callable[[torch.Tensor], None]) -> Callable:
        return lambda module, args, out: fn(out)

    def module(name: str) -> torch.nn.Module | None:
        found = getattr(attention, name, None)  # an HF attention's projections and norms vary by family
        return found if isinstance(found, torch.nn.Module) else None

    k_norm, v_source = module("k_norm"), module("v_proj")
    k_source = k_norm if k_norm is not None else module("k_proj")
    if k_source is not None and v_source is not None:
        return [k_source.register_forward_hook(output(keys)), v_source.register_forward_hook(output(values))]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if module("qkv_proj") is not None and k_norm is None:

        def fused(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            keys(out[..., q_size : q_size + kv_size])
            values(out[..., q_size + kv_size : q_size + 2 * kv_size])

        return [attention.qkv_proj.register_forward_hook(fused)]
    return []


def scales(amax: dict[int, list[float]]) -> dict[int, tuple[float, float]]:
    """Each layer's (k_scale, v_scale) from its recorded [key, value] maxima: over 448, or 1.0 for a
    maximum of 0. A maximum that is not finite is refused."""
    for i, (key, value) in amax.items():
        if not (math.isfinite(key) and math.isfinite(value)):
            raise ValueError(
                f"layer {i}'s keys or values reached {[key, value]} on the calibration text: not finite, so no "
                "KV-cache scale fits them (is the checkpoint's dtype too narrow for it?)"
            )
    return {
        i: (key / FP8_MAX if key > 0 else 1.0, value / FP8_MAX if value > 0 else 1.0)
        for i, (key, value) in amax.items()
    }
