"""`infer plugins`: every strategy by slot; `--matrix`: which combinations run on a device."""

from __future__ import annotations

import click

from infer.api.slots import SLOTS
from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config
from infer.core.registry import PluginRegistry


@click.command()
@click.option("--matrix", is_flag=True, help="Which attention x sampler x scheduler x decoding combinations run here.")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="The device --matrix checks against: cpu, cuda or cuda:N (cuda needs no GPU here: it reports what would run on one).",
)
@user_errors
def plugins(matrix: bool, device: str) -> None:
    """Every strategy by slot: name, distribution, version, capabilities."""
    registry = PluginRegistry.load(extra_plugins())
    if matrix:
        _matrix(registry, device)
        return
    rows = [("slot", "name", "distribution", "version", "capabilities")]
    for slot in SLOTS:
        strategies = sorted(registry.all(slot.name), key=lambda s: s.name)
        names = [s.name for s in strategies]
        for s in strategies:
            caps = s.capabilities.describe()
            reason = s.unavailable_reason()
            name = s.name
            if names.count(s.name) > 1:  # several implementations of one kind (layers): which is which
                name = f"{s.name} ({getattr(s.factory, '__name__', type(s.factory).__name__)})"
            rows.append(
                (slot.name, name, s.distribution, s.version, caps + (f"  [unavailable: {reason}]" if reason else ""))
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    for b in registry.broken:
        click.echo(f"failed to load: plugin {b.plugin} from {b.distribution}: {b.error}", err=True)


def _matrix(registry: PluginRegistry, device: str) -> None:
    from infer.tools.doctor import device_present
    from infer.tools.plugin_matrix import format_matrix, matrix, unavailable_here

    config = engine_config({"device": device})
    config.validate()
    target = config.resolve_device(require_present=False)  # cuda on a CPU machine: what would run there
    not_checked = None if device_present(target) else unavailable_here(registry)
    click.echo(format_matrix(matrix(registry, config, target), str(target), not_checked))
