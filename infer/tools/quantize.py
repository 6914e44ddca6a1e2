"""`infer models quantize`: a checkpoint's decoder projections written as FP8 (e4m3 with a scale per output
channel) or as 4-bit integers in groups (W4A16), in the compressed-tensors layouts llm-compressor writes,
which `--model DIR` loads as saved.

    infer models quantize smollm2-135m ./smollm2-fp8                  # GPTQ over 16 x 512 calibration tokens
    infer models quantize ./my-model ./my-model-fp8 --method rtn      # round to nearest: --quantization fp8's
    infer models quantize smollm2-135m ./smollm2-w4 --bits 4          # 4-bit GPTQ, groups of 64 here

4 bits (`--bits 4`): each group of `--group-size` input columns has a scale and a zero point (8 when
symmetric, the default), w ~ (q - z) * s, GPTQ's grid (`infer.kernels.int4_reference.group_grid`); gptq
chooses each group's grid when it reaches the group's first column, from the columns as the errors
compensated so far have moved them, as GPTQ does. The scales are stored in the checkpoint's dtype.

`rtn` rounds each weight to the nearest e4m3 value of its row's scale (max |w| / 448), as `--quantization fp8`
does at load. `gptq` keeps the same scales and rounds the columns of each weight one after another, each
rounding error spread over the columns not yet rounded in proportion to how the calibration text's
activations correlate them (GPTQ: Frantar et al., 2022, with the row scales fixed up front): it minimizes
the error of the layer's output on that text rather than of each weight. The activations are those of the
unquantized model (HF transformers' own implementation, float32), collected one decoder layer at a time
(`layer_hessians`), so that only one layer's statistics are in memory at once. The model is read into CPU
memory in its checkpoint's dtype, each layer widened to float32 in its turn; with a CUDA device
(`--device`, by default one when there is one) each decoder layer in turn, its statistics and its
projections' rounding run there.

The LM head and embeddings stay in the checkpoint's dtype; activations are quantized per token at run time
(the config says so), as under --quantization fp8.

gptq's calibration also gives each layer's FP8 KV-cache scales (`infer.tools.kv_calibration`), written beside
its weights as llm-compressor writes them; rtn reads no text and writes none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from infer.kernels.fp8_reference import to_e4m3
from infer.kernels.int4_reference import group_grid, pack_int32, quantize_rtn, round_to_grid
from infer.loading.quantization import compressed_int4_config
from infer.plugins.layer.fp8 import quantize_weight, weight_scales
from infer.tools import kv_calibration

METHODS = ("gptq", "awq", "rtn")
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


class _Captured(Exception):
    """Raised by the hook on the last decoder layer once every layer's inputs of a window are known: the rest
    of the forward is not needed."""


def decoder_layers(model: torch.nn.Module, names: Iterable[str]) -> tuple[str, torch.nn.ModuleList]:
    """(its name, the list) of the decoder layers that hold the projections `names` ("<list>.<i>.<...>")."""
    prefix = next(iter(names)).split(".layers.")[0] + ".layers"
    layers = model.get_submodule(prefix)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{prefix} is a {type(layers).__name__}, not the list of decoder layers")
    return prefix, layers


def _passthrough(*args: object, **kwargs: object) -> object:
    """A decoder layer's forward while `_layer_inputs` runs: its hidden states back, unchanged."""
    return args[0] if args else kwargs["hidden_states"]


def _layer_inputs(layers: torch.nn.ModuleList, model: torch.nn.Module, windows: list[list[int]]) -> tuple[list, list]:
    """(the first layer's hidden states, window by window; for each layer, each window's other arguments as
    the model passed them: (hidden state positional?, other positional args, keyword args)). Layers may
    differ in them (Gemma 2's alternate sliding-window and full attention masks); the tensors among them
    (masks, rotary tables) are shared between layers, and no later hidden state is kept. The layers hand
    their input straight on meanwhile (`_passthrough`): what the model passes a layer besides its hidden
    states does not depend on them, so the capture costs the embedding's lookup, not a forward."""
    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[bool, tuple, dict]]] = [[] for _ in layers]

    def capture(i: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if i == 0:
                hidden.append(args[0] if args else kwargs["hidden_states"])
            others = {key: value for key, value in kwargs.items() if key != "hidden_states"}
            calls[i].append((bool(args), args[1:], others))
            if i == len(layers) - 1:
                raise _Captured

        return hook

    hooks = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    for layer in layers:
        layer.forward = _passthrough  # the instance's, over its class's, until the `del` below
    try:
        with torch.no_grad():
            for window in windows:
                try:
                    model(torch.tensor([window]), use_cache=False)
                except _Captured:
                    pass
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            del layer.forward
    return hidden, calls


def _to(value: object, device: torch.device, moved: dict[int, torch.Tensor]) -> object:
    """`value` (a tensor, or tuples, lists and dicts of them) with its tensors on `device`; a tensor met
    twice (the masks and rotary tables every layer shares) is moved once (`moved`, by id)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in moved:
            moved[id(value)] = value.to(device)
        return moved[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, moved) for v in value)
    if isinstance(value, dict):
        return {key: _to(v, device, moved) for key, v in value.items()}
    return value


def layer_hessians(
    model: torch.nn.Module,
    windows: list[list[int]],
    device: torch.device | str = "cpu",
    keep: bool = True,
    kv_amax: dict[int, list[float]] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Per decoder layer in turn, the mean of x x^T over every token of `windows` that reaches each of its
    projections' input: {name: [K, K] float64}. Projections that read the same tensor (q, k and v; gate and
    up) share one matrix. The windows go through one layer at a time, each layer's outputs kept as the next
    one's inputs (`_layer_inputs` gives the first's and every layer's other arguments), so only one
    layer's matrices exist at once; the activations are the unquantized model's, as in one full forward.
    Each layer moves to `device` in float32 (with the windows' states) for its turn, and is there, with the
    matrices, while the caller holds them; when the next one is asked for it goes back to where it was, in
    its dtype, or with `keep` False to the meta device, its memory freed (the model is then spent). The rest
    of the model is expected in float32 (`quantize_folder` makes it so). With `kv_amax`, each layer's
    largest key and value on their way to its KV cache are recorded there too, [key, value] by layer index
    (`infer.tools.kv_calibration.observe`), before its matrices are yielded."""
    found = projections(model)
    prefix, layers = decoder_layers(model, found)
    text_config, scaling = model.config.get_text_config(), kv_calibration.rotary_scaling(model)
    hidden, calls = _layer_inputs(layers, model, windows)
    device = torch.device(device)
    moved: dict[int, torch.Tensor] = {}
    hidden = [h.to(device) for h in hidden]
    calls = [_to(layer_calls, device, moved) for layer_calls in calls]
    for i, layer in enumerate(layers):
        home = next(layer.parameters())
        home_device, home_dtype = home.device, home.dtype
        layer.to(device, torch.float32)
        mine = {name: m for name, m in found.items() if name.startswith(f"{prefix}.{i}.")}
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        same: dict[str, str] = {}  # projection -> the first one that read its input tensor
        # id of an input tensor of this window's call -> (the tensor, held so that its id is not reused by
        # another while the call runs; the first projection to read it)
        first: dict[int, tuple[torch.Tensor, str]] = {}

        def collect(name: str) -> Callable:
            def hook(module: torch.nn.Module, args: tuple) -> None:
                if (seen := first.get(id(args[0]))) is not None:
                    same[name] = seen[1]
                    return
                first[id(args[0])] = (args[0], name)
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.T @ x
                counts[name] = counts.get(name, 0) + x.shape[0]

            return hook

        hooks = [m.register_forward_pre_hook(collect(name)) for name, m in mine.items()]
        if kv_amax is not None:
            amax = [0.0, 0.0]
            if observers := kv_calibration.observe(layer, text_config, amax, scaling):
                hooks += observers
                kv_amax[i] = amax
        try:
            with torch.no_grad():
                for j, (positional, args, kwargs) in enumerate(calls[i]):
                    first.clear()
                    if positional:
                        out = layer(hidden[j], *args, **kwargs)
                    else:
                        out = layer(*args, hidden_states=hidden[j], **kwargs)
                    hidden[j] = out[0] if isinstance(out, tuple) else out
        finally:
            for hook in hooks:
                hook.remove()
        calls[i] = []
        means = {name: sums[name] / counts[name] for name in sums}
        yield {name: means[same.get(name, name)] for name in mine if same.get(name, name) in means}
        if keep:
            layer.to(home_device, home_dtype)
        else:
            layer.to("meta")


def hessians(model: torch.nn.Module, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Every projection's `layer_hessians` matrix at once (for small models: they all stay in memory)."""
    return {name: h for layer in layer_hessians(model, windows) for name, h in layer.items()}


def gptq(
    w: torch.Tensor, hessian: torch.Tensor, block: int = 128, damp: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as e4m3 [N, K] and a float32 scale per row [N] (rtn's scales), the columns rounded in order
    with each one's error compensated on the columns after it through the inverse of `hessian` [K, K]
    (dampened by `damp` x its mean diagonal). A column no token reaches (zero diagonal) is set to zero. Runs
    on `hessian`'s device (w is moved there); the results are on it too."""
    w = w.to(hessian.device, torch.float64, copy=True)
    n, k = w.shape
    scale = weight_scales(w)[:, None]  # [N, 1] float32: rtn's
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # the upper Cholesky factor of H^-1: row i holds how column i's error moves the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    for start in range(0, k, block):
        stop = min(start + block, k)
        part, errors, inv = (
            w[:, start:stop].clone(),
            torch.zeros(n, stop - start, dtype=w.dtype, device=w.device),
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


def gptq_int4(
    w: torch.Tensor,
    hessian: torch.Tensor,
    group: int,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] as 4-bit values (uint8 [N, K], 0..15), scales [N, G] float32 and zero points [N, G] uint8
    in groups of `group` columns (-1: one a row), w ~ (q - z) * s: `gptq`'s column order and error
    compensation, each group's grid (`group_grid`, its scale rounded to `scale_dtype`) chosen when its first
    column is reached, from the columns as the errors before have moved them (GPTQ's own choice)."""
    w = w.to(hessian.device, torch.float64, copy=True)
    n, k = w.shape
    g = k if group == -1 else group
    block = g if g >= 128 else (128 // g) * g  # whole groups in a block
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // g, dtype=torch.float32, device=w.device)
    zeros = torch.empty(n, k // g, dtype=torch.uint8, device=w.device)
    scale = zero = w.new_empty(0)
    for start in range(0, k, block):
        stop = min(start + block, k)
        part, errors = w[:, start:stop].clone(), torch.zeros(n, stop - start, dtype=w.dtype, device=w.device)
        inv = inverse[start:stop, start:stop]
        for i in range(stop - start):
            if (start + i) % g == 0:  # a group's first column: its grid from the columns as they are now
                s32, z32 = group_grid(part[:, i : i + g].float(), symmetric, scale_dtype)
                scales[:, (start + i) // g], zeros[:, (start + i) // g] = s32, z32.to(torch.uint8)
                scale, zero = s32.double(), z32.double()
            column = part[:, i]
            rounded = round_to_grid(column, scale, zero)
            q[:, start + i] = rounded.to(torch.uint8)
            error = (column - (rounded - zero) * scale) / inv[i, i]
            part[:, i:] -= error[:, None] * inv[i, i:][None, :]
            errors[:, i] = error
        w[:, stop:] -= errors @ inverse[start:stop, stop:]
    return q, scales, zeros


# AWQ's scales are folded into the norm before the projections that read its output (model types whose
# decoder layers are Llama's: an input norm before q, k, v, a post-attention norm before gate and up)
AWQ_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
AWQ_FOLDS = (
    ("input_layernorm", (("q_proj", "k_proj", "v_proj"), ("qkv_proj",))),
    ("post_attention_layernorm", (("gate_proj", "up_proj"), ("gate_up_proj",))),
)


def awq_scales(weights: list[torch.Tensor], hessian: torch.Tensor, group: int, grid: int = 20) -> torch.Tensor:
    """AWQ's per-input-channel scales s [K] for projections that read one input (Lin et al., 2023): w s is
    rounded to nearest (asymmetric groups) and the input divided by s, so salient channels (large inputs)
    keep more precision. s = a^r normalized, a each channel's RMS over the calibration tokens (sqrt of the
    diagonal of `hessian`, the mean of x x^T), r in [0, 1) on `grid` steps, the r whose rounding makes the
    least output error tr(D H D^T) over the projections (r = 0 is round to nearest: never worse)."""
    h = hessian.double()
    rms = torch.diag(h).clamp(min=0).sqrt()
    best, best_error = torch.ones_like(rms), float("inf")
    for step in range(grid):
        s = rms.pow(step / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = 0.0
        for w in weights:
            w = w.to(h.device, torch.float64)
            q, scale, zero = quantize_rtn(w * s, group, symmetric=False)
            g = w.shape[1] if group == -1 else group
            d = (q.double() - zero.double().repeat_interleave(g, 1)) * scale.double().repeat_interleave(g, 1) / s - w
            error += torch.trace(d @ h @ d.T).item()
        if error < best_error:
            best, best_error = s, error
    return best


def _awq_all(
    model: torch.nn.Module,
    windows: list[list[int]],
    progress: Callable[[str], object],
    device: torch.device,
    group: int,
    scale_dtype: torch.dtype,
) -> tuple[dict[str, tuple[torch.Tensor, ...]], dict[str, torch.Tensor]]:
    """Every projection's 4-bit (q, scale, zero) by AWQ, keyed by its weight's name, and the folded norms'
    new weights (norm weight / s, in the checkpoint's dtype), layer by layer on `device`. o_proj and
    down_proj (whose inputs no norm scales) are rounded to nearest."""
    model_type = model.config.get_text_config().model_type
    if model_type not in AWQ_MODEL_TYPES:
        raise ValueError(
            f"awq folds its scales into the norms before q, k, v and gate, up, which {model_type}'s layers do "
            f"not place as Llama's do (awq runs on {', '.join(AWQ_MODEL_TYPES)}): use --method gptq"
        )
    layers = projections(model)
    prefix, modules = decoder_layers(model, layers)
    progress(f"calibrating over {sum(len(w) for w in windows)} tokens in {len(windows)} windows (awq), on {device}")
    quantized: dict[str, tuple[torch.Tensor, ...]] = {}
    norms: dict[str, torch.Tensor] = {}
    for i, found in enumerate(layer_hessians(model, windows, device, keep=False)):
        scaled: dict[str, torch.Tensor] = {}
        for norm, choices in AWQ_FOLDS:
            names = next((c for c in choices if all(f"{prefix}.{i}.{_owner(p)}.{p}" in found for p in c)), None)
            if names is None:
                raise ValueError(f"layer {i} has no {' or '.join('/'.join(c) for c in choices)} to scale")
            full = [f"{prefix}.{i}.{_owner(p)}.{p}" for p in names]
            s = awq_scales([layers[n].weight.detach().float() for n in full], found[full[0]], group)
            scaled.update(dict.fromkeys(full, s))
            weight = modules[i].get_submodule(norm).weight  # float32 on `device` for its turn: stored as the checkpoint
            norms[f"{prefix}.{i}.{norm}.weight"] = (weight.detach().double().to(s.device) / s).to(scale_dtype).cpu()
        for name in found:
            w = layers[name].weight.detach().float().to(device)
            s = scaled.get(name)
            rounded = quantize_rtn(w if s is None else (w.double() * s).float(), group, False, scale_dtype)
            quantized[f"{name}.weight"] = tuple(t.cpu() for t in rounded)
        progress(f"{len(quantized)}/{len(layers)} projections quantized (awq)")
    return quantized, norms


def _owner(projection: str) -> str:
    return "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") else "mlp"


def _gptq_all(
    model: torch.nn.Module,
    windows: list[list[int]],
    progress: Callable[[str], object],
    device: torch.device,
    rounding: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] = gptq,
) -> tuple[dict[str, tuple[torch.Tensor, ...]], dict[int, tuple[float, float]]]:
    """Every projection's `rounding(weight, hessian)` (`gptq`: e4m3 weight and scale), keyed by its weight's name, layer by layer on
    `device`, the results in CPU memory; and each layer's KV-cache scales (k_scale, v_scale) by its index
    (`infer.tools.kv_calibration`). Each layer's memory is freed once its projections are rounded: the model
    is spent."""
    layers = projections(model)
    progress(
        f"calibrating over {sum(len(w) for w in windows)} tokens in {len(windows)} windows, layer by layer, on {device}"
    )
    quantized = {}
    model_type = model.config.get_text_config().model_type
    kv_amax: dict[int, list[float]] | None = {} if model_type in kv_calibration.MODEL_TYPES else None
    if kv_amax is None:
        progress(f"no KV-cache scales: {model_type}'s attention is not a layout calibration reads them from")
    for found in layer_hessians(model, windows, device, keep=False, kv_amax=kv_amax):
        for name, hessian in found.items():
            quantized[f"{name}.weight"] = tuple(
                t.cpu() for t in rounding(layers[name].weight.detach().float(), hessian)
            )
            if len(quantized) % 50 == 0 or len(quantized) == len(layers):
                progress(f"{len(quantized)}/{len(layers)} projections quantized (gptq)")
    if len(quantized) != len(layers):  # a projection no calibration token reached: its layer never ran it
        unseen = sorted(n for n in layers if f"{n}.weight" not in quantized)
        raise ValueError(
            f"no calibration token reached {unseen[0]} (and {len(unseen) - 1} more), so gptq has nothing to weigh "
            "its columns by: calibrate on other text (--calibration FILE), or use --method rtn"
        )
    return quantized, kv_calibration.scales(kv_amax or {})


def _float32_but_layers(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, loaded in its checkpoint's dtype, with the floating tensors that calibration reads outside
    its decoder layers (input embeddings, rotary tables, norms) in float32. The layers stay as stored, half
    the memory of a float32 copy for a bf16 checkpoint, until `layer_hessians` runs each in float32 in its
    turn (bf16 and fp16 widen to float32 exactly, so the statistics are those of the model loaded in
    float32); an untied LM head, which calibration never reaches, stays as stored too."""
    prefix, _ = decoder_layers(model, projections(model))
    head = model.get_output_embeddings()
    unread = {id(p) for p in head.parameters()} if head is not None else set()
    unread -= {id(p) for p in model.get_input_embeddings().parameters()}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(f"{prefix}.") and tensor.is_floating_point() and id(tensor) not in unread:
            tensor.data = tensor.data.float()
    return model


def int4_group(found: dict[str, torch.nn.Linear], group_size: int | None) -> int:
    """The group size of a 4-bit checkpoint of these projections: `group_size` (it must divide every
    projection's input; -1: per channel), or by default the largest of 128, 64 and 32 that divides them all
    (compressed-tensors names one for the whole model), else per channel."""
    odd = sorted(n for n, layer in found.items() if layer.in_features % 8 or layer.out_features % 8)
    if odd:
        raise ValueError(f"{odd[0]} is not a multiple of 8 wide both ways, which 4-bit values packed 8 to a word need")
    widths = sorted({layer.in_features for layer in found.values()})
    if group_size is None:
        return next((g for g in (128, 64, 32) if all(k % g == 0 for k in widths)), -1)
    if group_size != -1 and (group_size < 8 or any(k % group_size for k in widths)):
        raise ValueError(
            f"--group-size {group_size} does not divide the projections' inputs ({', '.join(map(str, widths))}): "
            f"use a size that divides them all, or -1 (a scale per output channel)"
        )
    return group_size


def _int4_tensors(
    name: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype, symmetric: bool
):
    """compressed-tensors pack-quantized tensors of projection weight `name` (its values + 8, 8 to an int32)."""
    prefix = name.removesuffix(".weight")
    out = {
        f"{prefix}.weight_packed": pack_int32(q, 1),
        f"{prefix}.weight_scale": scale.to(dtype),
        f"{prefix}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if not symmetric:
        out[f"{prefix}.weight_zero_point"] = pack_int32(zero, 0)
    return out


def quantize_folder(
    source: Path,
    out: Path,
    method: str = "gptq",
    windows: list[list[int]] | None = None,
    progress: Callable[[str], object] = print,
    device: torch.device | str = "cpu",
    bits: int = 8,
    group_size: int | None = None,
    symmetric: bool = True,
) -> Path:
    """Write `source` (an HF model folder) to `out` with its projections in FP8 (`bits` 8) or as 4-bit
    integers in groups (`bits` 4: `group_size`, symmetric or not, compressed-tensors pack-quantized)
    (`method`: gptq, over the calibration `windows` of token ids, on `device`, with each layer's KV-cache
    scales, or rtn). The weights are read and written one safetensors shard at a time, the output keeping
    the source's shard names (and an index when it has several); rtn loads no model, only each projection's
    tensor as its shard is written. Returns `out`."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if method != "rtn" and not windows:
        raise ValueError(f"{method} needs calibration windows (token ids)")
    if method == "awq" and bits != 4:
        raise ValueError("awq writes 4-bit weights: add --bits 4")
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise ValueError(
            f"{source} has no .safetensors weights: load it in transformers and save_pretrained() it to a new folder"
        )
    if method != "rtn":
        model = _float32_but_layers(AutoModelForCausalLM.from_pretrained(source, dtype="auto").eval())
    else:  # the projections' names only: a model on the meta device holds no weights
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    found = projections(model)
    targets = {f"{name}.weight" for name in found}
    if not targets:
        raise ValueError(f"{source} has no decoder projections to quantize")
    stored: set[str] = set()
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            stored.update(f.keys())
    missing = sorted(targets - stored)
    if missing:
        raise ValueError(f"{source}'s safetensors lack {missing[0]} (and {len(missing) - 1} more): not an HF folder")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    group = int4_group(found, group_size) if bits == 4 else 0
    scale_dtype = next(iter(found.values())).weight.dtype  # gptq: the checkpoint's (rtn reads each tensor's)
    prefix, _ = decoder_layers(model, found)

    def int4_rounding(w: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return gptq_int4(w, hessian, group, symmetric, scale_dtype)

    rounding = gptq if bits == 8 else int4_rounding
    norms: dict[str, torch.Tensor] = {}
    if method == "awq":
        symmetric = False  # AWQ's groups have a zero point
        quantized, norms = _awq_all(model, windows, progress, torch.device(device), group, scale_dtype)
        kv_scales: dict[int, tuple[float, float]] = {}
    else:
        quantized, kv_scales = (
            _gptq_all(model, windows, progress, torch.device(device), rounding) if method == "gptq" else ({}, {})
        )
    kv_scheme = {"kv_cache_scheme": kv_calibration.KV_CACHE_SCHEME} if kv_scales else {}
    del model  # what is left of it (embeddings, norms) is not needed to write the shards
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, done = 0, 0
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name not in targets:
                    tensors[name] = norms.pop(name, t)  # awq: a norm its scales were folded into
                    continue
                if bits == 4:
                    q, scale, zero = (
                        quantized.pop(name) if method != "rtn" else quantize_rtn(t, group, symmetric, t.dtype)
                    )
                    tensors.update(_int4_tensors(name, q, scale, zero, t.dtype, symmetric))
                else:
                    q, scale = quantized.pop(name) if method == "gptq" else quantize_weight(t.float())
                    tensors[name], tensors[name + "_scale"] = q, scale.float()[:, None]
                done += 1
                if method == "rtn" and (done % 50 == 0 or done == len(targets)):
                    progress(f"{done}/{len(targets)} projections quantized (rtn)")
        for i in [i for i in kv_scales if any(name.startswith(f"{prefix}.{i}.") for name in tensors)]:
            for which, value in zip("kv", kv_scales.pop(i)):  # beside the layer's weights
                tensors[f"{prefix}.{i}.self_attn.{which}_scale"] = torch.tensor(value, dtype=torch.float32)
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
        total += sum(t.nbytes for t in tensors.values())
    if kv_scales:  # every layer's projections are stored (checked above): its scales went beside them
        raise AssertionError(f"no shard holds layers {sorted(kv_scales)}'s tensors")
    index = source / "model.safetensors.index.json"
    if len(shards) > 1 or index.exists():
        (out / index.name).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    for f in source.iterdir():  # config, tokenizer, generation config: everything but the weights
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".safetensors.index.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    weights = QUANTIZATION_CONFIG if bits == 8 else compressed_int4_config(group, symmetric)
    scheme = {**weights, **kv_scheme}
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": scheme}, indent=2))
    return out
