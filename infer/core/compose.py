"""Turn a config's strategy names into checked strategies, before any weight loads.

Every refusal says which flag to change and to what.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.api.config import EngineConfig, ModelConfig
from infer.api.errors import ConfigError, IncompatiblePluginsError
from infer.api.slots import CHOSEN, PREFILL_ATTENTION
from infer.core.registry import PluginRegistry, Strategy


@dataclass(frozen=True, slots=True)
class Composition:
    attention: Strategy  # decode attention (and prefill when prefill_attention is None)
    prefill_attention: Strategy | None
    kv_allocator: Strategy
    scheduler: Strategy
    sampler: Strategy
    decoding: Strategy
    detokenizer: Strategy
    adapter: Strategy | None = None  # the adapter kind, when the run serves adapters (--enable-lora)

    def attention_backends(self) -> list[tuple[Strategy, str]]:
        """(strategy, its flag) for each attention backend that runs."""
        return [(self.attention, "--attention")] + [(p, "--prefill-attention") for p in [self.prefill_attention] if p]

    def names(self) -> dict[str, str]:
        """EngineConfig field -> strategy name, for the run's description."""
        # each chosen slot's name is also this dataclass's field for it (infer.api.slots): read by that name
        names = {s.field: chosen.name for s in CHOSEN if (chosen := getattr(self, s.name)) is not None}
        if self.prefill_attention is not None:
            names[PREFILL_ATTENTION.field] = self.prefill_attention.name
        return names


def _check_runs_here(s: Strategy, flag: str, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> None:
    caps = s.capabilities
    if device.type not in caps.devices:
        raise IncompatiblePluginsError(
            f"{flag} {s.name} runs only on {', '.join(sorted(caps.devices))}, not on {device.type}: "
            f"pick another {flag} or change --device"
        )
    if caps.dtypes is not None and dtype not in caps.dtypes:
        ok = ", ".join(sorted(str(d).removeprefix("torch.") for d in caps.dtypes))
        raise IncompatiblePluginsError(
            f"{flag} {s.name} does not support dtype {str(dtype).removeprefix('torch.')}: use --dtype {ok}"
        )
    if caps.block_sizes is not None and config.block_size not in caps.block_sizes:
        ok = ", ".join(map(str, sorted(caps.block_sizes)))
        raise IncompatiblePluginsError(
            f"{flag} {s.name} does not support --block-size {config.block_size}: use one of {ok}"
        )
    if config.world_size > 1 and not caps.distributed:
        split = "--tp" if config.tensor_parallel_size > 1 else "--pp"
        size = config.tensor_parallel_size if split == "--tp" else config.pipeline_parallel_size
        raise IncompatiblePluginsError(f"{flag} {s.name} cannot run with {split} {size}: use {split} 1")
    reason = s.unavailable_reason()
    if reason:
        raise IncompatiblePluginsError(f"{flag} {s.name} cannot run here: {reason}")


def refusal(s: Strategy, flag: str, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> str | None:
    """Why `s` cannot run here as `flag` (device, dtype, block size, tp, availability), or None."""
    try:
        _check_runs_here(s, flag, device, dtype, config)
    except IncompatiblePluginsError as exc:
        return str(exc)
    return None


def _auto_attention(
    registry: PluginRegistry, device: torch.device, dtype: torch.dtype, config: EngineConfig
) -> Strategy:
    candidates = []
    for s in registry.all("attention"):
        caps = s.capabilities
        if "decode" not in caps.phases or "prefill" not in caps.phases:
            continue
        if config.kv_cache_dtype == "fp8" and not caps.fp8_kv:
            continue
        try:
            _check_runs_here(s, "--attention", device, dtype, config)
        except IncompatiblePluginsError:
            continue
        candidates.append(s)
    if not candidates:
        raise IncompatiblePluginsError(
            f"no attention backend runs on {device.type} with {dtype}: install one or change --device"
        )
    return max(candidates, key=lambda s: (s.capabilities.priority, s.name == "torch"))


def compose(config: EngineConfig, registry: PluginRegistry, device: torch.device, dtype: torch.dtype) -> Composition:
    if config.attention == "auto":
        attention = _auto_attention(registry, device, dtype, config)
    else:
        attention = registry.get("attention", config.attention)
        if "decode" not in attention.capabilities.phases:  # say so before "cannot run here"
            raise IncompatiblePluginsError(
                f"--attention {attention.name} serves only {', '.join(sorted(attention.capabilities.phases))}: "
                f"use it as --prefill-attention {attention.name} with a decode backend such as --attention torch"
            )
        _check_runs_here(attention, "--attention", device, dtype, config)
    prefill = None
    if config.prefill_attention and config.prefill_attention != attention.name:
        prefill = registry.get("attention", config.prefill_attention)
        _check_runs_here(prefill, "--prefill-attention", device, dtype, config)
        if "prefill" not in prefill.capabilities.phases:
            raise IncompatiblePluginsError(
                f"--prefill-attention {prefill.name} does not serve prefill (it serves "
                f"{', '.join(sorted(prefill.capabilities.phases))}): pick a prefill-capable backend"
            )
    if prefill is None and "prefill" not in attention.capabilities.phases:
        raise IncompatiblePluginsError(
            f"--attention {attention.name} does not serve prefill: add --prefill-attention with a prefill backend"
        )
    # the adapter kind is built, and checked, only for a run that serves adapters
    others = [s for s in CHOSEN if s.name != "attention" and (s.name != "adapter" or config.enable_lora)]
    # the EngineConfig field that names each slot's strategy, read by its name in the slot table
    chosen = {s.name: registry.get(s.name, getattr(config, s.field)) for s in others}
    for s in others:
        _check_runs_here(chosen[s.name], s.flag, device, dtype, config)
    composition = Composition(attention=attention, prefill_attention=prefill, **chosen)
    _check_decoder_options(composition.decoding, config)
    able = ", ".join(s.name for s in registry.all("attention") if s.capabilities.fp8_kv) or "none installed"
    for s, flag in composition.attention_backends():
        if config.kv_cache_dtype == "fp8" and not s.capabilities.fp8_kv:
            raise IncompatiblePluginsError(
                f"--kv-cache-dtype fp8 needs an attention backend with an FP8 KV cache and {flag} {s.name} has none: "
                f"use {flag} with one that has it ({able}), or --kv-cache-dtype auto"
            )
    return composition


def _check_decoder_options(decoder: Strategy, config: EngineConfig) -> None:
    """--draft and --exit-layer against the decoder that would read them: missing, or doing nothing."""
    caps, name = decoder.capabilities, decoder.name
    if caps.needs_draft and not config.draft:
        raise IncompatiblePluginsError(
            f"--decoding {name} needs a draft model: add --draft NAME (a model, ngram, or self)"
        )
    if config.draft and not caps.needs_draft:
        raise IncompatiblePluginsError(
            f"--draft {config.draft} does nothing with --decoding {name}: add --decoding speculative, or drop --draft"
        )
    self_draft = caps.needs_draft and config.draft == "self"  # the target's first --exit-layer layers
    if (caps.uses_exit_layer or self_draft) and config.exit_layer is None:
        what = "--draft self" if self_draft else f"--decoding {name}"
        raise ConfigError(f"{what} needs --exit-layer N: the number of the target's decoder layers to keep")
    if config.exit_layer is not None and not (caps.uses_exit_layer or self_draft):
        raise IncompatiblePluginsError(
            f"--exit-layer {config.exit_layer} does nothing with --decoding {name}"
            + (f" --draft {config.draft}" if config.draft else "")
            + ": use --decoding early-exit or --decoding speculative --draft self, or drop --exit-layer"
        )


def check_model_attention(
    composition: Composition, registry: PluginRegistry, model_config: ModelConfig, max_model_len: int
) -> None:
    """The model's attention features (a sliding window shorter than the context, score soft-capping)
    against the backends that would run them."""
    windows = model_config.within_context(max_model_len).sliding_windows()
    able = ", ".join(s.name for s in registry.all("attention") if s.capabilities.sliding_window) or "none installed"
    for s, flag in composition.attention_backends():
        if windows and not s.capabilities.sliding_window:
            raise IncompatiblePluginsError(
                f"{model_config.name or 'the model'} uses sliding-window attention (window {windows[0]} tokens) "
                f"and {flag} {s.name} does not implement it: use {flag} with one that does ({able}), or "
                f"--max-model-len {windows[0]} (a context within the window needs none)"
            )
        if model_config.attention_soft_cap is not None and not s.capabilities.soft_cap:
            capped = ", ".join(a.name for a in registry.all("attention") if a.capabilities.soft_cap) or "none installed"
            raise IncompatiblePluginsError(
                f"{model_config.name or 'the model'} caps its attention scores (soft cap "
                f"{model_config.attention_soft_cap}) and {flag} {s.name} does not: use one that does ({capped})"
            )
