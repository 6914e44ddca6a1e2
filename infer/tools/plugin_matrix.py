"""`infer plugins --matrix`: which attention x sampler x scheduler x decoding combinations run on a
device, each refused one with the first reason `infer doctor` gives for it."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from types import SimpleNamespace

import torch

from infer.api.config import EngineConfig
from infer.api.slots import SLOT
from infer.core.registry import PluginRegistry
from infer.tools.doctor import device_present, diagnose

MATRIX_SLOTS = tuple(SLOT[name] for name in ("attention", "sampler", "scheduler", "decoding"))


def _on_a_machine_with_the_device(registry: PluginRegistry) -> PluginRegistry:
    """The registry as a machine with the asked-for device would see it: each strategy's own availability
    check (installed packages, a visible GPU) is about this machine, so it is left out."""
    strategies = {
        slot: {
            name: dataclasses.replace(
                s, factory=SimpleNamespace(capabilities=dataclasses.replace(s.capabilities, available=None))
            )
            for name, s in by_name.items()
        }
        for slot, by_name in registry.strategies.items()
    }
    return dataclasses.replace(registry, strategies=strategies)


def unavailable_here(registry: PluginRegistry) -> list[tuple[str, str]]:
    """(strategy, reason) for every strategy whose availability check fails on this machine."""
    return [
        (f"{slot.flag} {s.name}", reason)
        for slot in MATRIX_SLOTS
        for s in sorted(registry.all(slot.name), key=lambda s: s.name)
        if (reason := s.unavailable_reason())
    ]


def matrix(
    registry: PluginRegistry, base: EngineConfig, device: torch.device | None = None
) -> list[tuple[tuple[str, ...], str | None]]:
    """Every attention x sampler x scheduler x decoding combination with None (runs) or its first refusal
    (on `device`, when given; on a device this machine lacks, as a machine with it would see them,
    without the strategies' own availability checks: see `unavailable_here`)."""
    if device is not None and not device_present(device):
        registry = _on_a_machine_with_the_device(registry)
    names = [sorted(s.name for s in registry.all(slot.name)) for slot in MATRIX_SLOTS]
    rows = []
    for combo in itertools.product(*names):
        config = base.replace(**{slot.field: name for slot, name in zip(MATRIX_SLOTS, combo)})
        refusals = diagnose(config, registry, check_model=False, device=device).refusals
        rows.append((combo, refusals[0].reason if refusals else None))
    return rows


def format_matrix(
    rows: list[tuple[tuple[str, ...], str | None]], device: str, not_checked: list[tuple[str, str]] | None = None
) -> str:
    """not_checked: for a device this machine lacks, the availability checks the rows leave out."""
    runs = [combo for combo, reason in rows if reason is None]
    headers = tuple(slot.field for slot in MATRIX_SLOTS)
    widths = [max(len(h), *(len(c[i]) for c, _ in rows)) for i, h in enumerate(headers)]
    where = f"on {device}" if not_checked is None else f"on a machine with {device} (none here)"
    lines = [
        f"{len(runs)} of {len(rows)} combinations of {' x '.join(headers)} run {where}:",
        ("  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths))).rstrip(),
    ]
    lines += [("  " + "  ".join(c.ljust(w) for c, w in zip(combo, widths))).rstrip() for combo in runs]
    refused = Counter(reason for _, reason in rows if reason is not None)
    if refused:
        lines.append("refused (combinations: reason):")
        lines += [f"  {count:>4}: {reason}" for reason, count in refused.most_common()]
    if not_checked:
        lines.append("not checked without the device; on this machine:")
        lines += [f"  {name}: {reason}" for name, reason in not_checked]
    return "\n".join(lines)
