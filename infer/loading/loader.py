"""Finding a model (folder, cached name, named shape), reading its weights and tokenizer."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from infer.api.config import ModelConfig
from infer.api.errors import ModelLoadError, one_line
from infer.api.models import CheckpointShapes, QuantizedLinear
from infer.api.weights import check_shape
from infer.core.registry import PluginRegistry, Strategy
from infer.loading.config import model_config_from_hf, transformers_config


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    hf_config: dict[str, Any]
    path: Path | None  # folder with safetensors and tokenizer; None for dummy shapes
    architecture: Strategy
    tokenizer_path: Path | None = None  # folder with the tokenizer files; with dummy weights too, when on disk

    def model_config(self) -> ModelConfig:
        return model_config_from_hf(self.hf_config, name=self.name)


def _read_config(folder: Path) -> dict[str, Any]:
    """config.json read by transformers (AutoConfig), as its standardised dict: RoPE settings under
    rope_parameters whichever layout the file has."""
    from transformers import AutoConfig

    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json: point --model at an HF model folder")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path} ({one_line(exc)}): re-download or re-convert the model") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object: re-download or re-convert the model")
    if "model_type" not in raw:  # hand-written Llama shapes often omit it; transformers needs it for the rest
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        if architectures != ["LlamaForCausalLM"]:
            raise ModelLoadError(
                f"{path} has no model_type, which transformers needs to read it: add the "
                f'model_type of {architectures} ("llama" for LlamaForCausalLM)'
            )
        return transformers_config(raw, str(path)).to_dict()
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True).to_dict()
    except Exception as exc:  # transformers raises ValueError, KeyError, OSError, ... for a config it cannot read
        raise ModelLoadError(
            f"transformers cannot read {path} ({type(exc).__name__}: {one_line(exc)}): "
            f"fix config.json, or upgrade transformers for a newer model_type"
        ) from exc


def _has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and ((folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file())


def _from_folder(name: str, folder: Path, registry: PluginRegistry, load_format: str) -> ModelSource:
    hf = _read_config(folder)
    arch = registry.architecture_for((hf.get("architectures") or ["LlamaForCausalLM"])[0])
    tokenizer = folder if _has_tokenizer(folder) else None
    return ModelSource(name, hf, None if load_format == "dummy" else folder, arch, tokenizer)


def resolve_source(
    model: str,
    registry: PluginRegistry,
    load_format: str,
    pull: bool = True,
    revision: str | None = None,
    model_impl: str = "auto",
) -> ModelSource:
    """model: a folder (always wins), an HF repo id `org/name` (from the HF cache, at `revision`), a
    model in infer's cache, or a named shape. pull: download what is missing (else only look).
    model_impl: the model plugin that runs it (--model-impl); auto: the first claiming its architecture."""
    source = _resolve(model, registry, load_format, pull, revision)
    if model_impl == "auto":
        return source
    architecture = (source.hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
    return replace(source, architecture=registry.architecture_for(architecture, model_impl))


def with_tokenizer(source: ModelSource, tokenizer: str | None, registry: PluginRegistry) -> ModelSource:
    """`source` with the tokenizer of `tokenizer` (a folder, cached model or HF repo id, as --model);
    None: unchanged. Only the tokenizer's files are read."""
    if tokenizer is None:
        return source
    try:
        found = _resolve(tokenizer, registry, "dummy", False, None).tokenizer_path
    except ModelLoadError as exc:
        raise ModelLoadError(f"--tokenizer: {exc}") from None
    if found is None:
        raise ModelLoadError(
            f"--tokenizer {tokenizer} has no tokenizer files (tokenizer.json or tokenizer.model) on disk: "
            f"name a model folder or a cached model with one (`infer models pull NAME`)"
        )
    return replace(source, tokenizer_path=found)


def _resolve(model: str, registry: PluginRegistry, load_format: str, pull: bool, revision: str | None) -> ModelSource:
    from infer.loading import hub

    if not model.strip():
        raise ModelLoadError(
            f"--model is empty: name a model ({', '.join(registry.preset_names())}), an HF repo id (org/name) or a model folder"
        )
    folder = Path(model).expanduser()
    gguf = folder.suffix == ".gguf" and folder.is_file()
    if gguf or (folder.is_dir() and not (folder / "config.json").is_file() and any(folder.glob("*.gguf"))):
        # a GGUF file, its projections kept in their block formats (`hub.gguf_model`)
        converted = hub.resolve_model_path(folder)
        assert converted is not None  # a file or folder of one .gguf resolves, or raises naming the problem
        return _from_folder(folder.stem if gguf else folder.name, converted, registry, load_format)
    repo = not folder.is_dir() and hub.is_repo_id(model)
    if revision is not None and not repo:
        raise ModelLoadError(
            f"--revision {revision} applies to HF repo ids (org/name), not to {model}: drop --revision"
        )
    if folder.is_dir():
        return _from_folder(folder.name, folder, registry, load_format)
    if repo:
        return _from_folder(
            model,
            hub.snapshot_of(model, revision, download=pull, weights=load_format != "dummy"),
            registry,
            load_format,
        )
    if "/" in model or model.startswith((".", "~")):
        raise ModelLoadError(
            f"model folder {model} does not exist: check the path, or use an HF repo id (org/name) "
            f"or a named model ({', '.join(registry.preset_names())})"
        )
    return _from_name(model, registry, load_format, pull)


def _from_name(model: str, registry: PluginRegistry, load_format: str, pull: bool) -> ModelSource:
    from infer.loading import hub

    preset = registry.preset(model)
    cached = hub.find_cached(model)
    if load_format == "dummy":  # the shape's numbers; its tokenizer when the model is cached
        if preset is not None:
            return ModelSource(model, dict(preset[1]), None, preset[0], cached if _has_tokenizer(cached) else None)
        if cached is not None:
            return _from_folder(model, cached, registry, load_format)
        raise ModelLoadError(
            f"unknown model {model!r}: use a named shape ({', '.join(registry.preset_names())}) or an HF model folder"
        )
    if cached is None and pull and model in hub.KNOWN_SOURCES:
        cached = hub.pull(model)
    if cached is not None:
        return _from_folder(model, cached, registry, load_format)
    if preset is not None:
        raise ModelLoadError(
            f"no weights for {model} on this machine: add --load-format dummy for random weights of its shape, "
            f"or point --model at an HF model folder"
        )
    raise ModelLoadError(
        f"unknown model {model!r}: use an HF model folder, an HF repo id (org/name), a named shape "
        f"({', '.join(registry.preset_names())}), or pull one with `infer models pull NAME` ({', '.join(sorted(hub.KNOWN_SOURCES))})"
    )


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {folder}: the folder needs its weights, or use --load-format dummy"
        )
    return files


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of the folder's safetensors files; lazy: (name, slice), where
    indexing the slice (`s[rows]`, `s[:, cols]`) reads only those bytes (tensor-parallel ranks)."""
    from safetensors import SafetensorError, safe_open

    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"corrupt weight file {file} ({one_line(exc)}): re-download or re-convert the model"
            ) from exc


def iter_shapes(folder: Path) -> Iterator[tuple[str, tuple[int, ...], Path]]:
    """(name, shape, file) for every tensor of the folder's safetensors files, from their headers alone."""
    from safetensors import SafetensorError, safe_open

    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes = [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"corrupt weight file {file} ({one_line(exc)}): re-download or re-convert the model"
            ) from exc
        yield from ((name, shape, file) for name, shape in shapes)


def check_weight_shapes(model: nn.Module, folder: Path) -> None:
    """Every tensor's shape against what `model` expects, from the safetensors headers: no weight is
    read. A model that cannot say what it expects (no `checkpoint_shape`) is checked as it loads."""
    if isinstance(model, CheckpointShapes):
        for name, shape, file in iter_shapes(folder):
            check_shape(name, shape, model.checkpoint_shape(name), str(file))


def meta_model(source: ModelSource, config: ModelConfig, layers: Any) -> nn.Module:
    """The model of `source` at --tp 1 on the meta device: its parameters' shapes and no memory.
    layers: the run's (a quantized linear's weights have other shapes)."""
    with torch.device("meta"):
        return source.architecture.factory(config, layers, None)


def load_weights(model: nn.Module, folder: Path, sharded: bool = False) -> None:
    """sharded: the model is one tensor-parallel rank's; it reads only its slices of each tensor.
    The builder checks the shapes from the headers before the model is built (`check_weight_shapes`);
    the model checks each tensor again as it copies it."""
    # a CausalLM that is an nn.Module: typing has no intersection of a protocol and a class to declare it
    loaded = model.load_weights(iter_safetensors(folder, lazy=sharded))  # type: ignore[operator]
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ModelLoadError(
            f"weights in {folder} lack {len(missing)} tensors ({shown}): the checkpoint does not match its config.json"
        )


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shape (benchmarks without real weights). Each tensor is drawn from
    a generator seeded by `seed` and its name, and a tensor-parallel rank draws each full tensor as
    tp = 1 does and keeps its shard: the same model at any tp, and on any pipeline stage."""
    from infer.loading.shards import shard_of, take_quantized

    base = torch.Generator(device=next(model.parameters()).device)

    def generator(name: str) -> torch.Generator:  # each tensor its own stream: any subset draws the same values
        return base.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

    drawn: set[str] = set()  # quantized layers given their weight
    for name, param in model.named_parameters():
        gen = generator(name)
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, QuantizedLinear):  # drawn in float32 as a model-dtype weight, stored quantized
            own = [n for n, _ in module.named_parameters(recurse=False) if n != "bias"]
            if attr == "weight" or (own and "weight" not in own and attr == own[0]):  # once, for its weight in any form
                shard = shard_of(model, name)  # a tensor-parallel shard quantizes the full tensor's rows
                if attr != "weight":  # packed values under another name: the weight's shape is the layer's
                    shape = torch.Size((module.out_features, module.in_features))
                else:
                    shape = param.shape if shard is None else shard.full_shape(param.shape)
                full = torch.empty(shape, dtype=torch.float32, device=param.device).normal_(0.0, 0.02, generator=gen)
                if shard is None:
                    module.load_rows("weight", 0, shape[0], full)
                else:
                    take_quantized(module, shard, "weight", full)
                drawn.add(owner)
            elif attr == "bias":  # ones, as an unquantized layer's; a row-parallel shard's on the first only
                shard = module.__dict__.get("shard")
                param.fill_(0.0 if shard is not None and shard.dim == 1 and shard.ranges[0][0] != 0 else 1.0)
            continue
        if param.dim() == 1:
            param.fill_(1.0)  # norm weights
        elif (shard := shard_of(model, name)) is None:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            shard.take(param, param.new_empty(shard.full_shape(param.shape)).normal_(0.0, 0.02, generator=gen))
    for owner, module in model.named_modules():  # quantized layers with no weight parameter yet (GGUF's pieces)
        if isinstance(module, QuantizedLinear) and owner not in drawn and shard_of(model, f"{owner}.weight") is None:
            device = next(model.parameters()).device
            full = torch.empty(module.out_features, module.in_features, dtype=torch.float32, device=device)
            module.load_rows("weight", 0, module.out_features, full.normal_(0.0, 0.02, generator=generator(owner)))


def load_tokenizer(folder: Path | None) -> Any | None:
    if not _has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken tokenizer folder
        raise ModelLoadError(
            f"cannot load the tokenizer in {folder} ({type(exc).__name__}: {one_line(exc)}): re-convert the model"
        ) from exc
