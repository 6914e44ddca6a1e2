"""Per-engine plugin registry: entry points -> PluginManager -> name -> factory, resolved once.

Built-in plugins come through the same `infer` entry-point group as third-party ones. A plugin
that fails to import is recorded with its distribution and exception; it is fatal only when a
strategy it would have provided is asked for.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pluggy

from infer.api import (
    LAYER_KINDS,
    Capabilities,
    CheckpointQuantized,
    HFArchitectures,
    Layers,
    ModelPresets,
    QuantizedLinear,
    capabilities_of,
    hookspecs,
)
from infer.api.errors import PluginLoadError, PluginNotFoundError
from infer.api.slots import SLOT, SLOTS
from infer.core import plugin_api


@dataclass(frozen=True, slots=True)
class Strategy:
    slot: str
    name: str
    factory: Any
    plugin: str  # plugin (entry point) name
    distribution: str  # pip distribution that provides it
    version: str

    @property
    def capabilities(self) -> Capabilities:
        return capabilities_of(self.factory)

    def unavailable_reason(self) -> str | None:
        check = self.capabilities.available
        return check() if check is not None else None


@dataclass(frozen=True, slots=True)
class BrokenPlugin:
    plugin: str
    distribution: str
    error: str


@dataclass(slots=True)
class PluginRegistry:
    """Owns one PluginManager; build one per engine (two engines may differ in plugins)."""

    manager: pluggy.PluginManager
    strategies: dict[str, dict[str, Strategy]] = field(default_factory=dict)  # slot -> name -> strategy
    broken: list[BrokenPlugin] = field(default_factory=list)

    @classmethod
    def load(cls, extra_plugins: Iterable[Any] = (), entry_points: bool = True) -> "PluginRegistry":
        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        registry = cls(manager=manager)
        sources: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        if entry_points:
            for ep in md.entry_points(group=hookspecs.PROJECT_NAME):
                dist = ep.dist.name if ep.dist else "unknown"
                version = ep.dist.version if ep.dist else "?"
                try:
                    module = ep.load()
                    if manager.is_registered(module):
                        continue
                    api_problem = plugin_api.mismatch(module)
                    if api_problem is not None:
                        registry.broken.append(BrokenPlugin(ep.name, dist, f"plugin API mismatch: {api_problem}"))
                        continue
                    manager.register(module, name=ep.name)
                except Exception as exc:  # a broken third-party plugin must not break others
                    registry.broken.append(BrokenPlugin(ep.name, dist, f"{type(exc).__name__}: {exc}"))
                    continue
                sources[ep.name] = (dist, version)
        for i, plugin in enumerate(extra_plugins):
            if manager.is_registered(plugin):  # installed too (a built-in module passed explicitly)
                continue
            # a plugin is any module or object: a module, class or function has a __name__, an instance none
            name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{i}"
            api_problem = plugin_api.mismatch(plugin)
            if api_problem is not None:
                registry.broken.append(BrokenPlugin(name, "(inline)", f"plugin API mismatch: {api_problem}"))
                continue
            manager.register(plugin, name=name)
            sources[name] = ("(inline)", "")
        manager.check_pending()  # a misspelled hook name fails loudly
        for slot in SLOTS:
            registry.strategies[slot.name] = {}
            # pluggy's hook relay has one attribute per hook spec: the slot table names it
            for impl in getattr(manager.hook, slot.hook).get_hookimpls():
                dist, version = sources.get(impl.plugin_name, ("unknown", ""))
                register = registry._register_fn(slot.name, impl.plugin_name, dist, version)
                try:
                    impl.function(register)
                except Exception as exc:
                    registry.broken.append(BrokenPlugin(impl.plugin_name, dist, f"{type(exc).__name__}: {exc}"))
        return registry

    def _register_fn(self, slot: str, plugin: str, dist: str, version: str):
        def register(name: str, factory: Any) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"plugin {plugin} registered a {slot} with an empty or non-string name")
            existing = self.strategies[slot].get(name)
            if existing is not None and slot != "layer":
                raise PluginLoadError(
                    f"{slot} {name!r} is registered twice: by {existing.distribution} ({existing.plugin}) "
                    f"and by {dist} ({plugin}); uninstall one of them"
                )
            # layers: a kind has many implementations, each plugin's one a kind (a linear: one a scheme)
            scheme = _scheme(factory) if slot == "layer" and name == "linear" else None
            key = name if slot != "layer" else f"{name}:{plugin}" + (f":{scheme}" if scheme else "")
            self.strategies[slot][key] = Strategy(slot, name, factory, plugin, dist, version)

        return register

    def names(self, slot: str) -> list[str]:
        return sorted(self.strategies[slot])

    def get(self, slot: str, name: str) -> Strategy:
        found = self.strategies[slot].get(name)
        if found is not None:
            return found
        known = ", ".join(f"{s.name} ({s.distribution})" for s in self.strategies[slot].values()) or "none"
        hint = ""
        if self.broken:
            hint = "; plugins that failed to load: " + ", ".join(
                f"{b.plugin} from {b.distribution} ({b.error})" for b in self.broken
            )
        close = difflib.get_close_matches(name, list(self.strategies[slot]), n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise PluginNotFoundError(f"unknown {SLOT[slot].flag} {name!r}: {guess}valid names are {known}{hint}")

    def all(self, slot: str) -> list[Strategy]:
        return list(self.strategies[slot].values())

    def layer(self, kind: str, device_type: str, quantization: str | None = None) -> Any:
        """The highest-priority runnable implementation of a layer kind on this device; for "linear"
        one registered for `quantization` (its class's `quantization`; None: an unquantized one)."""
        found = [s for s in self.strategies["layer"].values() if s.name == kind]
        if kind == "linear":
            schemes = sorted({q for s in found if (q := _scheme(s.factory))})
            found = [s for s in found if _scheme(s.factory) == quantization]
            if quantization is not None and not found:
                raise PluginNotFoundError(
                    f"unknown --quantization {quantization!r}: use one of {', '.join(schemes) or 'none installed'}"
                )
        options = [s for s in found if device_type in s.capabilities.devices and s.unavailable_reason() is None]
        if not options:
            scheme = f" for --quantization {quantization}" if quantization else ""
            raise PluginNotFoundError(
                f"no implementation of model layer {kind!r}{scheme} runs on {device_type}: install a layers "
                f"plugin that has one{', or drop --quantization' if quantization else ''}"
            )
        return max(options, key=lambda s: s.capabilities.priority).factory

    def layers(
        self, device_type: str, quantization: str | None = None, checkpoint: Mapping[str, Any] | None = None
    ) -> Layers:
        """Every layer kind's implementation for this device (see `layer`), and the quantized linear: a
        `CheckpointQuantized` class configured by the checkpoint's `quantization_config` (`checkpoint`)."""
        quantized = self.layer("linear", device_type, quantization) if quantization else None
        if isinstance(quantized, CheckpointQuantized):
            quantized = quantized.for_checkpoint(checkpoint)
        return Layers(**{kind: self.layer(kind, device_type) for kind in LAYER_KINDS}, quantized_linear=quantized)

    def architecture_for(self, hf_architecture: str, model_impl: str = "auto") -> Strategy:
        """The model plugin that runs checkpoints of `hf_architecture`: `model_impl` when named (it must
        claim the architecture), else the first that claims it."""
        models = [s for s in self.strategies["model"].values() if isinstance(s.factory, HFArchitectures)]
        if model_impl != "auto":
            chosen = self.get("model", model_impl)  # an unknown name raises, listing the valid ones
            serving = [s.name for s in models if hf_architecture in s.factory.hf_architectures]
            if chosen not in models or hf_architecture not in chosen.factory.hf_architectures:
                raise PluginNotFoundError(
                    f"--model-impl {model_impl} does not claim architecture {hf_architecture!r}: use "
                    f"{' or '.join(['auto', *serving])}"
                )
            return chosen
        for strategy in models:
            if hf_architecture in strategy.factory.hf_architectures:
                return strategy
        known = sorted(a for s in models for a in s.factory.hf_architectures)
        raise PluginNotFoundError(
            f"no model plugin serves architecture {hf_architecture!r}: supported are {', '.join(known)}"
        )

    def preset(self, name: str) -> tuple[Strategy, dict[str, Any]] | None:
        for strategy in self.strategies["model"].values():
            if isinstance(strategy.factory, ModelPresets) and name in strategy.factory.presets:
                return strategy, strategy.factory.presets[name]
        return None

    def preset_names(self) -> list[str]:
        models = self.strategies["model"].values()
        return sorted(n for s in models if isinstance(s.factory, ModelPresets) for n in s.factory.presets)


def _scheme(linear: Any) -> str | None:
    """The quantization a linear layer class registered for (`QuantizedLinear`); None: unquantized."""
    return linear.quantization if isinstance(linear, QuantizedLinear) else None
