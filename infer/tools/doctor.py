"""`infer doctor`: whether a configuration runs here, slot by slot, before any weight loads.

For each slot: OK, or refused with the reason and the strategies of that slot that do run here.
The verdict agrees with `compose` (the builder's own check), which runs last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from infer.api.config import DTYPES, EngineConfig
from infer.api.errors import ConfigError, InferError
from infer.api.slots import CHOSEN, PREFILL_ATTENTION, SLOT
from infer.core.compose import _auto_attention, check_model_attention, compose, refusal
from infer.core.registry import BrokenPlugin, PluginRegistry, Strategy
from infer.loading.quantization import run_dtype


@dataclass(frozen=True, slots=True)
class Verdict:
    slot: str  # a registry slot, or "config", "device", "model", "draft", "combination"
    chosen: str  # what the configuration asks for
    reason: str | None = None  # None: runs here
    alternatives: tuple[str, ...] = ()  # strategies of this slot that run here
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(slots=True)
class Diagnosis:
    device: str
    dtype: str
    verdicts: list[Verdict] = field(default_factory=list)
    broken: list[BrokenPlugin] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return all(v.ok for v in self.verdicts)

    @property
    def refusals(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok]


def _phase_refusal(s: Strategy, as_prefill: bool, has_prefill_backend: bool) -> str | None:
    phases = s.capabilities.phases
    if as_prefill:
        if "prefill" not in phases:
            return f"--prefill-attention {s.name} does not serve prefill (it serves {', '.join(sorted(phases))})"
        return None
    if "decode" not in phases:
        return (
            f"--attention {s.name} serves only {', '.join(sorted(phases))}: use it as --prefill-attention "
            f"{s.name} with a decode backend"
        )
    if "prefill" not in phases and not has_prefill_backend:
        return f"--attention {s.name} does not serve prefill: add --prefill-attention with a prefill backend"
    return None


def _slot_refusal(
    slot: str, s: Strategy, config: EngineConfig, device: torch.device, dtype: torch.dtype, as_prefill: bool = False
) -> str | None:
    flag = PREFILL_ATTENTION.flag if as_prefill else SLOT[slot].flag
    if slot == "attention":
        phase = _phase_refusal(s, as_prefill, bool(config.prefill_attention))
        if phase is not None:
            return phase
    if slot == "decoding" and s.capabilities.needs_draft and not config.draft:
        return f"--decoding {s.name} needs a draft model: add --draft NAME"
    return refusal(s, flag, device, dtype, config)


def _verdict(
    registry: PluginRegistry,
    slot: str,
    name: str,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    as_prefill: bool = False,
) -> Verdict:
    label = PREFILL_ATTENTION.field if as_prefill else slot
    try:
        chosen = registry.get(slot, name)
        reason = _slot_refusal(slot, chosen, config, device, dtype, as_prefill)
    except InferError as exc:
        reason = str(exc)
    if reason is None:
        return Verdict(label, name)
    runs = tuple(
        s.name + (" (lossy)" if s.capabilities.lossy else "")
        for s in sorted(registry.all(slot), key=lambda s: s.name)
        if s.name != name and _slot_refusal(slot, s, config, device, dtype, as_prefill) is None
    )
    return Verdict(label, name, reason, runs)


def _model(config: EngineConfig, registry: PluginRegistry) -> tuple[list[Verdict], Any]:
    """The model's verdict (and an FP8 KV cache's: its scales), and its ModelConfig (None if unreadable)."""
    from infer.loading import hub
    from infer.loading.loader import check_weight_shapes, meta_model, resolve_source

    try:
        source = resolve_source(
            config.model,
            registry,
            config.load_format,
            pull=False,
            revision=config.revision,
            model_impl=config.model_impl,
        )
    except InferError as exc:
        if config.load_format != "dummy" and config.model in hub.KNOWN_SOURCES and registry.preset(config.model):
            return [Verdict("model", config.model, note="not cached yet: `infer run` downloads it once")], None
        return [Verdict("model", config.model, str(exc), _runnable_models(registry, config.model))], None
    try:
        mc = source.model_config()
        if source.path is not None:  # the safetensors headers against the config's shapes; no weight is read
            check_weight_shapes(meta_model(source, mc, registry.layers("cpu")), source.path)
    except InferError as exc:
        return [Verdict("model", config.model, str(exc))], None
    weights = "dummy weights" if source.path is None else f"weights in {source.path}"
    note = f"{source.architecture.name}, {mc.num_layers} layers, {mc.num_heads}/{mc.num_kv_heads} heads, {weights}"
    if config.exit_layer is not None and not 1 <= config.exit_layer <= mc.num_layers:
        return [Verdict("model", config.model, f"--exit-layer must be in [1, {mc.num_layers}] for {source.name}")], None
    verdicts = [Verdict("model", config.model, note=note)]
    if config.kv_cache_dtype == "fp8":
        verdicts.append(_kv_cache(source, mc))
    return verdicts, mc


def _kv_cache(source: Any, mc: Any) -> Verdict:
    """An FP8 KV cache's scales: the checkpoint's calibrated ones (`infer.loading.kv_scales`), or 1.0."""
    from infer.loading.kv_scales import read_kv_scales

    if source.path is None:
        return Verdict("kv_cache", "fp8", note="scales 1.0: dummy weights")
    try:
        scales = read_kv_scales(source.path, mc.num_layers)
    except InferError as exc:
        return Verdict("kv_cache", "fp8", str(exc))
    if scales is None:
        return Verdict("kv_cache", "fp8", note="scales 1.0: the checkpoint holds no calibrated KV scales")
    k, v = zip(*scales)
    return Verdict(
        "kv_cache",
        "fp8",
        note=f"the checkpoint's calibrated scales, k {min(k):.3g}-{max(k):.3g}, v {min(v):.3g}-{max(v):.3g}",
    )


def _quantization(config: EngineConfig, registry: PluginRegistry, device: torch.device, mc: Any) -> Verdict:
    """The linear layer that holds the quantized weights (--quantization, or the checkpoint's scheme)."""
    from infer.api.config import ModelConfig
    from infer.loading.quantization import quantization_for

    asked = config.quantization or "(the checkpoint's)"
    try:
        scheme = quantization_for(config.quantization, mc or ModelConfig())
        layer = registry.layer("linear", device.type, scheme)
    except InferError as exc:
        return Verdict("quantization", asked, str(exc))
    return Verdict("quantization", asked, note=f"{scheme}: {layer.__module__}.{layer.__name__}")


def _logits_processors(registry: PluginRegistry) -> Verdict:
    """Every installed logits processor is built and serves the requests that ask for it: never a
    refusal, but one that cannot run here is named with the reason."""
    found = sorted(registry.all(SLOT["logits_processor"].name), key=lambda s: s.name)
    why = {s.name: s.unavailable_reason() for s in found}
    ready = [name for name, reason in why.items() if reason is None]
    note = f"{len(ready)} of {len(found)} ready: {', '.join(ready) or 'none'}"
    note += "".join(f"; {name} unavailable: {reason}" for name, reason in why.items() if reason)
    return Verdict("logits_processor", "all", note=note)


def diagnose(
    config: EngineConfig, registry: PluginRegistry, check_model: bool = True, device: torch.device | None = None
) -> Diagnosis:
    """Every slot's verdict for `config` on this machine (on `device`, when given, present or not);
    reads config.json files, safetensors headers and an FP8 KV cache's scales, never weights."""
    verdicts: list[Verdict] = []
    try:
        config.validate()
    except ConfigError as exc:
        verdicts.append(Verdict("config", "", str(exc)))
    if device is None:
        try:
            device = config.resolve_device()
        except ConfigError as exc:
            verdicts.append(Verdict("device", config.device, str(exc), ("cpu",)))
            device = torch.device("cuda" if config.device.startswith("cuda") else "cpu")
    model_config = None
    if check_model:
        model_verdicts, model_config = _model(config, registry)
        verdicts.extend(model_verdicts)
    model_dtype = model_config.torch_dtype if model_config is not None else None
    dtype = (
        config.resolve_dtype(device, model_dtype) if config.dtype == "auto" or config.dtype in DTYPES else torch.float32
    )
    if model_config is not None and config.dtype == "auto":
        try:  # the engine's own choice (4-bit weights run in bf16 on the CPU)
            dtype = run_dtype(config, registry, device, model_config)
        except InferError:
            pass  # an unknown or unloadable quantization: its own verdict says so
    if config.quantization is not None or (model_config and model_config.extra.get("quantization_config")):
        verdicts.append(_quantization(config, registry, device, model_config))
    if config.tensor_parallel_size > 1:
        verdicts.append(_tensor_parallel(config, registry))
        verdicts.append(_all_reduce(config, device, dtype))
    if config.attention == "auto":
        try:
            verdicts.append(
                Verdict("attention", "auto", note=f"auto picks {_auto_attention(registry, device, dtype, config).name}")
            )
        except InferError as exc:
            verdicts.append(Verdict("attention", "auto", str(exc)))
    for slot in CHOSEN:
        if slot.name == "adapter" and not config.enable_lora:  # built only for a run that serves adapters
            continue
        if not (slot.name == "attention" and config.attention == "auto"):
            # the EngineConfig field that names the slot's strategy, by its name in the slot table
            verdicts.append(_verdict(registry, slot.name, getattr(config, slot.field), config, device, dtype))
        if slot.name == "attention" and config.prefill_attention:
            verdicts.append(
                _verdict(registry, "attention", config.prefill_attention, config, device, dtype, as_prefill=True)
            )
    verdicts.append(_logits_processors(registry))
    if check_model and config.draft and config.draft not in ("ngram", "self"):
        from infer.loading.loader import resolve_source

        try:
            resolve_source(config.draft, registry, config.load_format, pull=False)
            verdicts.append(Verdict("draft", config.draft))
        except InferError as exc:
            verdicts.append(Verdict("draft", config.draft, str(exc), ("ngram", "self")))
    if all(v.ok for v in verdicts):
        try:
            composition = compose(config, registry, device, dtype)
            if model_config is not None:  # the model's sliding window and soft cap against the backends
                limit = config.max_model_len or model_config.context_limit()[0]
                check_model_attention(composition, registry, model_config, limit)
        except InferError as exc:
            verdicts.append(Verdict("combination", "", str(exc)))
    return Diagnosis(str(device), str(dtype).removeprefix("torch."), verdicts, list(registry.broken))


def _runnable_models(registry: PluginRegistry, asked: str) -> tuple[str, ...]:
    """Models that run here instead: those cached on this machine, then named shapes with random weights."""
    from infer.loading import hub

    cached = [n for n in sorted(hub.KNOWN_SOURCES) if n != asked and hub.find_cached(n) is not None]
    shapes = [f"{n} --load-format dummy" for n in registry.preset_names() if n != asked and n not in cached]
    return (*cached, *shapes[: max(0, 4 - len(cached))])


def format_diagnosis(d: Diagnosis) -> str:
    lines = [f"infer doctor: device {d.device}, dtype {d.dtype}"]
    widths = [max([4, *(len(v.slot) for v in d.verdicts)]), max([5, *(len(v.chosen or "-") for v in d.verdicts)])]
    indent = " " * (sum(widths) + 6)
    lines.append(f"  {'slot'.ljust(widths[0])}  {'asked'.ljust(widths[1])}  verdict")
    for v in d.verdicts:
        head = f"  {v.slot.ljust(widths[0])}  {(v.chosen or '-').ljust(widths[1])}  "
        if v.ok:
            lines.append(f"{head}OK" + (f"  ({v.note})" if v.note else ""))
            continue
        lines.append(f"{head}REFUSED: {v.reason}")
        if v.alternatives:
            lines.append(f"{indent}runs here instead: {', '.join(v.alternatives)}")
        elif v.slot in SLOT:
            lines.append(f"{indent}nothing else in this slot runs here with these options")
    for b in d.broken:
        lines.append(f"  plugin {b.plugin} from {b.distribution} failed to load: {b.error}")
    refused = len(d.refusals)
    lines.append(
        "verdict: runs here"
        if not refused
        else f"verdict: cannot run here ({refused} refusal{'s' if refused > 1 else ''}); change the flags named above"
    )
    return "\n".join(lines)


def device_present(device: torch.device) -> bool:
    return device.type != "cuda" or (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())


def _all_reduce(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Verdict:
    """Which all-reduce --tp will use for small tensors (the set-up itself needs the ranks)."""
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce
    from infer.distributed.all_reduce import peer_access_reason
    from infer.distributed.all_reduce import symm_mem as symmetric_memory
    from infer.distributed.state import ParallelState

    tp = config.tensor_parallel_size
    # rank 0's view of the GPUs the ranks would take (too few GPUs is the tensor-parallel verdict's)
    no_peers = (
        peer_access_reason(ParallelState(0, tp, device))
        if device.type == "cuda" and torch.cuda.device_count() >= (device.index or 0) + tp
        else None
    )
    # doctor does not build FlashInfer's kernels (minutes on first use): the engine does, and says so
    flashinfer_why = no_peers or flashinfer_all_reduce.unavailable_reason(device, tp, dtype, build=False)
    if config.all_reduce == "flashinfer":
        return Verdict(
            "all-reduce",
            "flashinfer",
            flashinfer_why and f"flashinfer's all-reduce cannot run: {flashinfer_why}",
            ("nccl", "auto"),
        )
    reason = no_peers or symmetric_memory.unavailable_reason(device, tp, dtype)
    if config.all_reduce == "symm-mem" and reason:
        return Verdict("all-reduce", "symm-mem", f"symmetric memory cannot run: {reason}", ("nccl", "auto"))
    if config.all_reduce == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
        if flashinfer_why is None:
            note = (
                "auto picks flashinfer (fused with the residual add and RMSNorm; its kernels are compiled on "
                f"first use) up to {flashinfer_all_reduce.MAX_TOKENS} tokens, nccl above"
            )
        elif reason is None:
            note = f"auto picks symm-mem for small tensors, nccl above (flashinfer: {flashinfer_why})"
        else:
            note = f"auto picks {backend} (flashinfer: {flashinfer_why}; symmetric memory: {reason})"
        return Verdict("all-reduce", "auto", note=note)
    return Verdict("all-reduce", config.all_reduce)


def _tensor_parallel(config: EngineConfig, registry: PluginRegistry) -> Verdict:
    """Whether the model's heads and MLP split over --tp ranks (no weights are read)."""
    from infer.distributed.state import check_tensor_parallel
    from infer.loading.loader import resolve_source

    tp = str(config.tensor_parallel_size)
    try:
        mc = resolve_source(
            config.model, registry, config.load_format, pull=False, revision=config.revision
        ).model_config()
        check_tensor_parallel(mc.name, mc.num_heads, mc.num_kv_heads, mc.intermediate_size, config.tensor_parallel_size)
    except InferError as exc:
        return Verdict("tp", tp, str(exc))
    return Verdict("tp", tp)
