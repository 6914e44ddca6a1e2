"""Which quantization a run's linear layers use: `--quantization`, or the one a checkpoint was saved in.

A checkpoint says so in config.json's `quantization_config`. Read here: FP8 weights as llm-compressor
writes them (`quant_method` compressed-tensors, float 8-bit weights, a scale per output channel or per
tensor) and the per-tensor `fp8` layout (`weight_scale` beside each weight). Both load as `fp8`, their
values and scales as they are; activations are quantized per token at run time, so a checkpoint's static
`input_scale` is not read. 4-bit weights with 16-bit activations (`infer.plugins.layer.int4`) load as
`gptq` (AutoGPTQ / GPTQModel), `awq` (AutoAWQ's GEMM layout) and `w4a16` (compressed-tensors
`pack-quantized`, 4-bit integers in groups or per channel). Other schemes are refused by name, before any
weight is read.
"""

from __future__ import annotations

from typing import Any, Mapping

from infer.api.config import ModelConfig
from infer.api.errors import ConfigError, ModelLoadError

FP8_WEIGHT_STRATEGIES = ("channel", "tensor")


def checkpoint_scheme(config: ModelConfig) -> str | None:
    """The scheme the checkpoint's weights are stored in (fp8), or None for unquantized weights."""
    qc = config.extra.get("quantization_config")
    if not qc:
        return None
    qc = qc if isinstance(qc, Mapping) else qc.to_dict()  # transformers may hand a config object
    method = str(qc.get("quant_method", ""))
    where = f"config.json of {config.name or 'the model'}"
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ModelLoadError(
                f"{where} stores FP8 weights with a scale per {qc['weight_block_size']} block, which no layers "
                f"plugin here loads: use a checkpoint with a scale per channel or per tensor"
            )
        return "fp8"
    if method == "gguf":  # a .gguf file's projections in their block formats (`infer.loading.gguf.gguf_folder`)
        return "gguf"
    if method in ("gptq", "awq"):
        _check_int4(where, method, qc)
        return method
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if groups and all(_is_int4_group(g) for g in groups.values()):
            for name, group in groups.items():
                _check_int4_group(where, name, group, qc)
            return "w4a16"
        for name, group in groups.items():
            _check_fp8_group(where, name, group)
        return "fp8"
    raise ModelLoadError(
        f"{where} stores weights quantized with {method or 'an unnamed method'!r}, which no layers plugin here "
        f"loads: use the model's bf16 checkpoint (add --quantization fp8 to quantize it as it loads)"
    )


def _check_int4(where: str, method: str, qc: Mapping[str, Any]) -> None:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ModelLoadError(
            f"{where} stores {bits}-bit {method.upper()} weights; only 4-bit ones load here: use a 4-bit "
            f"checkpoint, or the bf16 one"
        )
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(
            f"{where} stores AWQ weights in the {qc.get('version')!r} layout; only AutoAWQ's GEMM layout loads "
            f"here: use a GEMM checkpoint"
        )
    if method == "gptq" and str(qc.get("checkpoint_format", "gptq")) not in ("gptq", "gptq_v2"):
        raise ModelLoadError(
            f"{where} stores GPTQ weights in the {qc.get('checkpoint_format')!r} format; the gptq (v1) and "
            f"gptq_v2 formats load here: convert the checkpoint to one of those"
        )


def _is_int4_group(group: Mapping[str, Any]) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type") == "int" and weights.get("num_bits") == 4


def _check_int4_group(where: str, name: str, group: Mapping[str, Any], qc: Mapping[str, Any]) -> None:
    weights, fmt = group.get("weights") or {}, qc.get("format")
    if group.get("input_activations"):
        raise ModelLoadError(
            f"{where}: quantization group {name} quantizes activations too; only 4-bit weights with 16-bit "
            f"activations (W4A16) load here: use a W4A16 checkpoint"
        )
    if fmt != "pack-quantized":
        raise ModelLoadError(
            f"{where} stores 4-bit weights as {fmt!r}; only compressed-tensors' pack-quantized format loads "
            f"here: save the checkpoint with it (llm-compressor's default for W4A16)"
        )
    if weights.get("strategy") not in ("group", "channel"):
        raise ModelLoadError(
            f"{where}: quantization group {name} scales 4-bit weights per {weights.get('strategy')}; a scale "
            f"per group or per channel loads here: use such a checkpoint"
        )


def _check_fp8_group(where: str, name: str, group: Mapping[str, Any]) -> None:
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ModelLoadError(
            f"{where}: quantization group {name} stores {weights.get('num_bits')}-bit {weights.get('type')} "
            f"weights; only 8-bit float (FP8) ones load here: use an FP8 or a bf16 checkpoint"
        )
    if weights.get("strategy") not in FP8_WEIGHT_STRATEGIES:
        raise ModelLoadError(
            f"{where}: quantization group {name} scales FP8 weights per {weights.get('strategy')}; only a scale "
            f"per channel or per tensor loads here: use such a checkpoint, or the bf16 one"
        )


def quantization_for(requested: str | None, config: ModelConfig) -> str | None:
    """`--quantization` if given (it must agree with a quantized checkpoint), else the checkpoint's. Any
    --tp: the tensor-parallel projections hold the quantized linear's shards (`infer.distributed.layers`)."""
    stored = checkpoint_scheme(config)
    if requested is not None and stored is not None and requested != stored:
        raise ConfigError(
            f"--quantization {requested} asks for weights that {config.name or 'the model'} stores as {stored}: "
            f"drop --quantization, or use the model's bf16 checkpoint"
        )
    return requested or stored


def checkpoint_quantization(config: ModelConfig) -> dict[str, Any] | None:
    """config.json's `quantization_config` as a dict (None: an unquantized checkpoint)."""
    qc = config.extra.get("quantization_config")
    if not qc:
        return None
    return dict(qc) if isinstance(qc, Mapping) else dict(qc.to_dict())


def compressed_int4_config(group_size: int, symmetric: bool, act_order: bool = False) -> dict[str, Any]:
    """config.json's `quantization_config` of a compressed-tensors W4A16 checkpoint (pack-quantized), as
    llm-compressor writes it: 4-bit integer weights in groups of `group_size` (-1: per channel)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "dynamic": False,
        "strategy": "group" if group_size != -1 else "channel",
        "group_size": group_size if group_size != -1 else None,
        "actorder": "group" if act_order else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


def run_dtype(config: Any, registry: Any, device: Any, model_config: ModelConfig) -> Any:
    """The run's activation dtype: `EngineConfig.resolve_dtype`, except that with --dtype auto on the CPU a
    quantized linear that prefers another (`CpuDtypePreferring`: 4-bit weights run in bf16) gets it."""
    from infer.api import CpuDtypePreferring

    dtype = config.resolve_dtype(device, model_config.torch_dtype)
    quantization = quantization_for(config.quantization, model_config)
    if config.dtype == "auto" and device.type == "cpu" and quantization is not None:
        linear = registry.layer("linear", device.type, quantization)
        if isinstance(linear, CpuDtypePreferring):
            return linear.cpu_dtype
    return dtype
