"""The conformance kit's selection: which installed strategies `--infer-kit SLOT=NAME` names, and
where each can be tested here. Used by `infer.testing.pytest_plugin` and the suites it collects."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from infer.api.errors import InferError
from infer.api.slots import find
from infer.core.registry import PluginRegistry, Strategy

# the slots with a suite, suites/kit_<slot>.py
SLOTS = ("attention", "sampler", "kv_allocator", "decoding", "model", "logits_processor", "reasoning_parser")
SUITES = Path(__file__).resolve().parent / "suites"


@dataclass(slots=True)
class Selection:
    registry: PluginRegistry
    strategies: dict[str, list[Strategy]] = field(default_factory=dict)  # slot -> strategies under test

    def describe(self) -> str:
        return ", ".join(
            f"{slot}={s.name} ({' '.join(filter(None, (s.distribution, s.version)))})"
            for slot, found in self.strategies.items()
            for s in found
        )


SELECTION = pytest.StashKey[Selection]()


def parse(specs: list[str]) -> dict[str, list[str]]:
    """['attention=my-attn', 'sampler=a'] -> {'attention': ['my-attn'], 'sampler': ['a']}; a slot may be
    spelled as its config field or an alias (decoding=, kv-allocator=, allocator=)."""
    wanted: dict[str, list[str]] = {}
    for spec in specs:
        word, sep, names = spec.partition("=")
        found = find(word)
        slot = found.name if found is not None else word.strip()
        if not sep or slot not in SLOTS or not names.strip():
            raise pytest.UsageError(
                f"--infer-kit {spec!r}: write SLOT=NAME with SLOT one of {', '.join(SLOTS)} "
                f"and NAME a strategy that `infer plugins` lists, e.g. --infer-kit attention=my-attn"
            )
        for name in filter(None, (n.strip() for n in names.split(","))):
            if name not in wanted.setdefault(slot, []):
                wanted[slot].append(name)
    return wanted


def select(specs: list[str]) -> Selection:
    wanted = parse(specs)
    selection = Selection(PluginRegistry.load())
    for slot, names in wanted.items():
        try:
            selection.strategies[slot] = [selection.registry.get(slot, name) for name in names]
        except InferError as exc:
            raise pytest.UsageError(f"--infer-kit: {exc}") from exc
    return selection


def suite_paths(selection: Selection) -> list[str]:
    paths = [SUITES / f"kit_{slot}.py" for slot in SLOTS if slot in selection.strategies]
    missing = [p.name for p in paths if not p.is_file()]
    assert not missing, f"no suite for {missing}: each slot in SLOTS has its infer/testing/suites/kit_<slot>.py"
    return [str(p) for p in paths]


def strategies(config: pytest.Config, slot: str) -> list[Strategy]:
    selection = config.stash.get(SELECTION, None)
    return [] if selection is None else selection.strategies.get(slot, [])


def device_for(strategy: Strategy) -> tuple[torch.device | None, str | None]:
    """The device to test a strategy on (CUDA when it runs there and one is visible), or why none."""
    caps = strategy.capabilities
    reason = strategy.unavailable_reason()
    if reason:
        return None, f"{strategy.slot} {strategy.name} cannot run here: {reason}"
    if "cuda" in caps.devices and torch.cuda.is_available():
        return torch.device("cuda"), None
    if "cpu" in caps.devices:
        return torch.device("cpu"), None
    return None, f"{strategy.slot} {strategy.name} runs only on {', '.join(sorted(caps.devices))}, which is not here"


def dtype_for(strategy: Strategy) -> torch.dtype:
    dtypes = strategy.capabilities.dtypes
    if dtypes is None or torch.float32 in dtypes:
        return torch.float32
    return torch.bfloat16 if torch.bfloat16 in dtypes else sorted(dtypes, key=str)[0]


def param(strategy: Strategy, *values: object, id: str) -> object:
    """A pytest.param for this strategy, skipped (with the reason) where it cannot run here."""
    device, reason = device_for(strategy)
    marks = [pytest.mark.skip(reason=reason)] if device is None else []
    return pytest.param(strategy, device, *values, id=f"{strategy.name}-{id}" if id else strategy.name, marks=marks)
