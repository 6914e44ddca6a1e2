"""4-bit checkpoints for tests: a saved float model rewritten in GPTQ's, AWQ's or compressed-tensors' layout,
beside the same model with the dequantized weights, the reference HF transformers runs.

`quantize_checkpoint` rounds every decoder projection (q, k, v, o, gate, up, down) to nearest in groups
(`infer.kernels.int4_reference.quantize_rtn`, GPTQ's grid), optionally with act-order (the columns grouped in a
random order, one order per projection input, recorded as `g_idx`), writes each layout's tensors and
config.json's `quantization_config` as those tools do, and writes a second folder whose weights are
the values those tensors stand for, (q - z) * s in float32. The compressed-tensors layout packs with
the compressed-tensors package's own `pack_to_int32` where it is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from infer.kernels.int4_reference import AWQ_ORDER, pack_int32, quantize_rtn
from infer.loading.quantization import compressed_int4_config

LAYOUTS = ("gptq", "awq", "w4a16")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
                "up_proj": "mlp", "down_proj": "down", "qkv_proj": "attn", "gate_up_proj": "mlp"}  # fmt: skip


def _quantize(w: torch.Tensor, group: int, symmetric: bool, perm: torch.Tensor | None):
    """(q [N, K], s [N, G], z [N, G], g_idx [K], dequantized [N, K]) of w, grouped in `perm`'s column order."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    q_perm, s, z = quantize_rtn(w[:, order], group, symmetric)
    q = torch.empty_like(q_perm)
    q[:, order] = q_perm
    g = k if group == -1 else group
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = torch.arange(k, dtype=torch.int32) // g
    deq = (q.float() - z.float()[:, g_idx.long()]) * s[:, g_idx.long()]
    return q, s, z, g_idx, deq


def _signed_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' packing of values in [0, 15] (its int4 values + 8), by the package when present."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        return pack_int32(values, dim)
    return pack_to_int32((values.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=dim)


def quantization_config(layout: str, group: int, symmetric: bool, act_order: bool) -> dict[str, Any]:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric, "desc_act": act_order,
                "checkpoint_format": "gptq"}  # fmt: skip
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return compressed_int4_config(group, symmetric, act_order)


def _layout_tensors(layout: str, prefix: str, q, s, z, g_idx, symmetric: bool, act_order: bool) -> dict:
    if layout == "gptq":
        out = {
            "qweight": pack_int32(q.t(), 0),
            "qzeros": pack_int32((z.to(torch.int16) - 1).clamp(0, 15).t(), 1),  # format v1: zero - 1
            "scales": s.t().to(torch.float16),
            "g_idx": g_idx,
        }
    elif layout == "awq":
        out = {
            "qweight": pack_int32(q.t(), 1, AWQ_ORDER),
            "qzeros": pack_int32(z.t(), 1, AWQ_ORDER),
            "scales": s.t().to(torch.float16),
        }
    else:
        out = {
            "weight_packed": _signed_int32(q, 1),
            "weight_scale": s,
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
        if not symmetric:
            out["weight_zero_point"] = _signed_int32(z, 0)
        if act_order:
            out["weight_g_idx"] = g_idx
    return {f"{prefix}.{name}": t.contiguous() for name, t in out.items()}


def quantize_checkpoint(
    src: Path, dst: Path, layout: str, group: int = 32, symmetric: bool = True, act_order: bool = False, seed: int = 0
) -> Path:
    """`src` (a float safetensors folder) as a `layout` 4-bit checkpoint in `dst`; returns the reference folder
    (`dst` + "-reference"): `src` with every projection's weight the dequantized values. The scales are
    rounded to the layout's stored dtype first (fp16; compressed-tensors: the model's), so the reference
    holds exactly what the checkpoint does. AWQ has no symmetric form (a zero point always)."""
    from safetensors.torch import load_file, save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}")
    symmetric = symmetric and layout != "awq"
    reference = dst.with_name(dst.name + "-reference")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    deq_all: dict[str, torch.Tensor] = {}
    stored = torch.float16 if layout in ("gptq", "awq") else next(iter(tensors.values())).dtype
    for name, w in tensors.items():
        proj = next((p for p in PROJECTIONS if name.endswith(f".{p}.weight")), None)
        if proj is None:
            packed[name] = deq_all[name] = w
            continue
        layer = name.rsplit(f".{proj}.", 1)[0]
        perm = None
        if act_order:
            key = (layer, SHARED_INPUT[proj])
            perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=gen))
        q, s, z, g_idx, _ = _quantize(w, group, symmetric, perm)
        s = s.to(stored)  # what the file holds
        deq_all[name] = ((q.float() - z.float()[:, g_idx.long()]) * s.float()[:, g_idx.long()]).to(w.dtype)
        packed.update(_layout_tensors(layout, name.removesuffix(".weight"), q, s, z, g_idx, symmetric, act_order))
        if name.replace(".weight", ".bias") in tensors:
            packed[name.replace(".weight", ".bias")] = tensors[name.replace(".weight", ".bias")]
    for folder, content in ((dst, packed), (reference, deq_all)):
        folder.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json" and extra.is_file():
                shutil.copy(extra, folder / extra.name)
        save_file(content, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout, group, symmetric, act_order)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return reference
