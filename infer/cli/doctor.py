"""`infer doctor`: the command; the diagnosis is infer.tools.doctor's."""

from __future__ import annotations

import sys
from typing import Any

import click

from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config, engine_options


@click.command()
@engine_options
@user_errors
def doctor(**engine_opts: Any) -> None:
    """Whether these flags can run here, slot by slot, and what would instead (exit 0: runs, 2: not)."""
    from infer.core.registry import PluginRegistry
    from infer.tools.doctor import diagnose, format_diagnosis

    diagnosis = diagnose(engine_config(engine_opts), PluginRegistry.load(extra_plugins()))
    click.echo(format_diagnosis(diagnosis))
    sys.exit(0 if diagnosis.runnable else 2)
