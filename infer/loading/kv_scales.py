"""A checkpoint's calibrated FP8 KV-cache scales, which `--kv-cache-dtype fp8` reads its cache with.

Quantizers that calibrate an FP8 KV cache store, beside each layer's weights, the scales its keys and
values are read with (a stored key x means x * k_scale): llm-compressor's `kv_cache_scheme` as
`model.layers.N.self_attn.k_scale` / `v_scale` (`qkv_proj.k_scale` where the checkpoint fuses q, k and
v, `attn.k_scale` in vLLM's own names), older compressed-tensors checkpoints as the k and v projections'
`output_scale`, ModelOpt as `k_proj.k_scale` / `v_proj.v_scale`, AutoFP8's first layout as one
`kv_scale` for both (a layer's own k or v scale comes first). Two different values for one layer's
k (or v) scale are refused. An FP8 cache allocated for such a checkpoint reads each layer with its scales
(`infer.runtime.kv_cache.FP8KVCache`); a layer it gives none keeps 1.0. A scale of several elements (one
per KV head) is taken as its largest: every head's values then fit e4m3's range, the smaller heads with
fewer of its bits. The model's weights ignore these tensors, and a cache in the model's dtype does not
read them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from infer.api.errors import ModelLoadError
from infer.loading.loader import iter_safetensors

# layer index, then which tensor: a k_scale, a v_scale, or a kv_scale (both)
_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.((?:attn\.|qkv_proj\.)?(?:k_scale|v_scale|kv_scale)"
    r"|k_proj\.(?:output_scale|k_scale)|v_proj\.(?:output_scale|v_scale))$"
)


def _kind(suffix: str) -> str:
    last = suffix.rsplit(".", 1)[-1]
    if last == "output_scale":
        return suffix[0]  # k_proj. / v_proj.
    return last.removesuffix("_scale")  # k, v or kv


def read_kv_scales(folder: Path, num_layers: int) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) for each of the first `num_layers` layers from the checkpoint in `folder` (1.0
    where a layer has none; a layer's own k_scale or v_scale before its kv_scale), or None when it
    holds no KV-cache scale. Only those tensors are read."""
    found: dict[tuple[int, str], tuple[float, str]] = {}
    for name, tensor in iter_safetensors(folder, lazy=True):  # a slice: read only where it is a scale
        match = _NAME.search(name)
        if match is None or int(match.group(1)) >= num_layers:
            continue
        key, value = (int(match.group(1)), _kind(match.group(2))), _scale(name, tensor[...], folder)
        if key in found and found[key][0] != value:
            raise ModelLoadError(
                f"{folder} holds two {key[1]}_scale values for layer {key[0]}: {found[key][1]} = "
                f"{found[key][0]} and {name} = {value}; keep one in the checkpoint, or drop "
                f"--kv-cache-dtype fp8"
            )
        found[key] = (value, name)
    if not found:
        return None
    scales = {key: value for key, (value, _) in found.items()}
    return [
        (
            scales.get((layer, "k"), scales.get((layer, "kv"), 1.0)),
            scales.get((layer, "v"), scales.get((layer, "kv"), 1.0)),
        )
        for layer in range(num_layers)
    ]


def _scale(name: str, tensor: torch.Tensor, folder: Path) -> float:
    values = tensor.float().flatten()
    if values.numel() == 0 or not all(math.isfinite(v) and v > 0 for v in values.tolist()):
        shown = values.tolist()[:4]
        raise ModelLoadError(
            f"tensor {name} in {folder} holds {shown}, not a KV-cache scale (a positive, finite number): re-export "
            f"the checkpoint's KV scales, or drop --kv-cache-dtype fp8 (its cache then keeps the model's dtype)"
        )
    return float(values.max())
