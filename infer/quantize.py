"""`infer models quantize`: a checkpoint's decoder projections written as FP8 (e4m3 with a scale per output
channel), in the compressed-tensors layout llm-compressor writes, which `--model DIR` loads as saved.

    infer models quantize smollm2-135m ./smollm2-fp8                  # GPTQ over 16 x 512 calibration tokens
    infer models quantize ./my-model ./my-model-fp8 --method rtn      # round to nearest: --quantization fp8's

`rtn` rounds each weight to the nearest e4m3 value of its row's scale (max |w| / 448), as `--quantization fp8`
does at load. `gptq` keeps the same scales and rounds the columns of each weight one after another, each
rounding error spread over the columns not yet rounded in proportion to how the calibration text's
activations correlate them (GPTQ: Frantar et al., 2022, with the row scales fixed up front): it minimizes
the error of the layer's output on that text rather than of each weight. The activations are those of the
unquantized model (HF transformers' own implementation, float32, CPU), collected in one pass.

The LM head and embeddings stay in the checkpoint's dtype; activations are quantized per token at run time
(the config says so), as under --quantization fp8.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from infer.kernels.fp8_reference import FP8_MAX_INV, SCALE_MIN, to_e4m3
from infer.plugins.layers.fp8 import quantize_weight

METHODS = ("gptq", "rtn")
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "type": "float",
                "num_bits": 8,
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            },
        }
    },
}


def projections(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The decoder layers' linear layers (attention and MLP projections) of an HF model, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"}


def hessians(model: torch.nn.Module, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per projection, the mean of x x^T over every token of `windows` that reaches its input: [K, K] float64."""
    layers = projections(model)
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in layers.items()}
    counts = dict.fromkeys(layers, 0)

    def collect(name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] += x.T @ x
            counts[name] += x.shape[0]

        return hook

    hooks = [m.register_forward_pre_hook(collect(name)) for name, m in layers.items()]
    try:
        with torch.no_grad():
            for window in windows:
                model(torch.tensor([window]))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: sums[name] / max(1, counts[name]) for name in layers}


def gptq(
    w: torch.Tensor, hessian: torch.Tensor, block: int = 128, damp: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as e4m3 [N, K] and a float32 scale per row [N] (rtn's scales), the columns rounded in order
    with each one's error compensated on the columns after it through the inverse of `hessian` [K, K]
    (dampened by `damp` x its mean diagonal). A column no token reaches (zero diagonal) is set to zero."""
    w = w.double().clone()
    n, k = w.shape
    scale = (w.abs().amax(dim=1).float().clamp(min=SCALE_MIN) * FP8_MAX_INV)[:, None]  # [N, 1] float32: rtn's
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    # the upper Cholesky factor of H^-1: row i holds how column i's error moves the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for start in range(0, k, block):
        stop = min(start + block, k)
        part, errors, inv = (
            w[:, start:stop].clone(),
            torch.zeros(n, stop - start, dtype=w.dtype),
            inverse[start:stop, start:stop],
        )
        for i in range(stop - start):
            column = part[:, i]
            rounded = to_e4m3(column.float()[:, None], scale)
            q[:, start + i] = rounded[:, 0]
            error = (column - (rounded.float() * scale)[:, 0].double()) / inv[i, i]
            part[:, i:] -= error[:, None] * inv[i, i:][None, :]
            errors[:, i] = error
        w[:, stop:] -= errors @ inverse[start:stop, stop:]
    return q, scale[:, 0]


def quantize_folder(
    source: Path,
    out: Path,
    method: str = "gptq",
    windows: list[list[int]] | None = None,
    progress: Callable[[str], object] = print,
) -> Path:
    """Write `source` (an HF model folder) to `out` with its projections in FP8 (`method`: gptq, over the
    calibration `windows` of token ids, or rtn). Returns `out`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if method == "gptq" and not windows:
        raise ValueError("gptq needs calibration windows (token ids)")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    layers = projections(model)
    if not layers:
        raise ValueError(f"{source} has no decoder projections to quantize")
    found = hessians(model, windows) if method == "gptq" else {}
    if found:
        progress(f"calibrated over {sum(len(w) for w in windows)} tokens in {len(windows)} windows")
    quantized: dict[str, torch.Tensor] = {}
    for i, (name, module) in enumerate(layers.items()):
        w = module.weight.detach().float()
        q, scale = gptq(w, found[name]) if method == "gptq" else quantize_weight(w)
        quantized[f"{name}.weight"], quantized[f"{name}.weight_scale"] = q, scale.float()[:, None]
        if (i + 1) % 50 == 0 or i + 1 == len(layers):
            progress(f"{i + 1}/{len(layers)} projections quantized ({method})")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            if name in quantized:
                tensors[name], tensors[name + "_scale"] = quantized[name], quantized[name + "_scale"]
            else:
                tensors[name] = t
    missing = sorted(n for n in quantized if n not in tensors)
    if missing:
        raise ValueError(f"{source}'s safetensors lack {missing[0]} (and {len(missing) - 1} more): not an HF folder")
    for f in source.iterdir():  # config, tokenizer, generation config: everything but the weights
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".safetensors.index.json"):
            shutil.copy(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}, indent=2))
    return out
