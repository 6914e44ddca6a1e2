"""Which quantization a run's linear layers use: `--quantization`, or the one a checkpoint was saved in.

A checkpoint says so in config.json's `quantization_config`. Read here: FP8 weights as llm-compressor
writes them (`quant_method` compressed-tensors, float 8-bit weights, a scale per output channel or per
tensor) and the per-tensor `fp8` layout (`weight_scale` beside each weight). Both load as `fp8`, their
values and scales as they are; activations are quantized per token at run time, so a checkpoint's static
`input_scale` is not read. Other schemes are refused by name, before any weight is read.
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
    if method == "compressed-tensors":
        for name, group in (qc.get("config_groups") or {}).items():
            _check_fp8_group(where, name, group)
        return "fp8"
    raise ModelLoadError(
        f"{where} stores weights quantized with {method or 'an unnamed method'!r}, which no layers plugin here "
        f"loads: use the model's bf16 checkpoint (add --quantization fp8 to quantize it as it loads)"
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
