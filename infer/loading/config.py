"""A model's config.json (or a named preset's dict) read through transformers into a `ModelConfig`."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from infer.api.config import DTYPES, ModelConfig
from infer.api.errors import ModelLoadError, one_line

# settings a family's plugin reads from ModelConfig.extra, under transformers' names (the core reads none);
# quantization_config: how the checkpoint's weights are stored (infer.loading.quantization)
FAMILY_KEYS = (
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "mlp_bias",
    "final_logit_softcapping",
    "quantization_config",
)


def _set(hf: Any, key: str) -> bool:
    return getattr(hf, key, None) is not None  # an HF config: a family's own field is absent from the others'


def kv_layout(hf: Any) -> tuple[int, int]:
    """(KV heads, head dim) of a transformers config: `num_key_value_heads` and `head_dim` where it sets
    them (some families' configs have neither, or None), else the query heads and hidden_size / heads."""
    heads = int(hf.num_attention_heads)
    # an HF config: both fields are optional across families and transformers versions
    kv_heads = getattr(hf, "num_key_value_heads", None)
    head_dim = getattr(hf, "head_dim", None)  # likewise optional
    return int(kv_heads or heads), int(head_dim or int(hf.hidden_size) // heads)


def layer_windows(hf: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers' models apply `sliding_window`: the layers whose
    `layer_types` entry is sliding_attention (Qwen2, Qwen3, Gemma 2), or every layer where the config
    has no layer_types (Mistral, Phi-3). Empty when no layer is windowed."""
    window = getattr(hf, "sliding_window", None)  # an HF config: only windowed families have the field
    if not window:
        return ()
    num_layers = int(hf.num_hidden_layers)
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * num_layers  # newer transformers only
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds[:num_layers])
    return windows if any(w is not None for w in windows) else ()


def model_config_from_hf(hf: Any, name: str = "") -> ModelConfig:
    """From a transformers `PretrainedConfig`, or a config.json-style dict that transformers reads
    (old layout: top-level rope_theta / rope_scaling; new: rope_parameters). The RoPE is checked
    here, so a config transformers cannot use fails before any weight is read."""
    from infer.api.rope import rope_for

    source = f"config.json of {name}" if name else "the model's config.json"
    if isinstance(hf, Mapping):
        hf = transformers_config(hf, source)
    try:
        num_heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        num_kv_heads, head_dim = kv_layout(hf)
        eos = hf.eos_token_id
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = hf.dtype if isinstance(hf.dtype, torch.dtype) else DTYPES.get(str(hf.dtype or ""))
        config = ModelConfig(
            architecture=(hf.architectures or ["LlamaForCausalLM"])[0],
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(hf.max_position_embeddings),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_parameters=dict(hf.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
            name=name,
            layer_windows=layer_windows(hf),
            attention_scale=float(hf.query_pre_attn_scalar) ** -0.5 if _set(hf, "query_pre_attn_scalar") else None,
            attention_soft_cap=float(hf.attn_logit_softcapping) if _set(hf, "attn_logit_softcapping") else None,
            extra={key: getattr(hf, key) for key in FAMILY_KEYS if _set(hf, key)},  # those this family's config has
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{source} is missing a field or has a bad one ({one_line(exc)}): fix config.json"
        ) from exc
    rope_for(
        config.rope_parameters,
        config.head_dim,
        config.hidden_size,
        config.num_heads,
        config.max_position_embeddings,
        source,
    )
    return config


def transformers_config(hf: Mapping[str, Any], source: str = "config.json") -> Any:
    """A transformers config object from a config.json-style dict (model_type defaults to llama, the
    family of the named presets). Refuses, naming `source`, what transformers refuses."""
    from transformers import CONFIG_MAPPING

    model_type = hf.get("model_type", "llama")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"{source} has model_type {model_type!r}, which transformers does not know: "
            f"fix model_type, or upgrade transformers"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(hf))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot read {source} ({one_line(exc)}): fix config.json") from exc
