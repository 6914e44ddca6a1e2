"""`infer`: run, plugins, doctor, bench, models. Thin: parse, build, print. User errors exit 2 with one line."""

from __future__ import annotations

import sys
from typing import Any

import click

from infer.api.errors import InferError, one_line
from infer.api.vllm import refusal
from infer.cli.bench import bench
from infer.cli.common import extra_plugins
from infer.cli.doctor import doctor
from infer.cli.models import models
from infer.cli.plugins import plugins
from infer.cli.run import run


class OneLineErrors(click.Group):
    """Every user error, click's usage errors and InferErrors alike, is one `error: ...` line on stderr."""

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # `infer` alone: the help text
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            # a vLLM flag that infer lacks: why, and what to do instead
            refused = refusal(exc.option_name) if isinstance(exc, click.NoSuchOption) else None
            if refused is not None:
                click.echo(f"error: {refused}", err=True)
                sys.exit(exc.exit_code)
            ctx = exc.ctx if isinstance(exc, click.UsageError) else None  # a usage error knows its command
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            message = exc.format_message()
            click.echo(f"error: {one_line(message[:1].lower() + message[1:]).rstrip('.')}{hint}", err=True)
            sys.exit(exc.exit_code)
        except InferError as exc:  # a command registered by a plugin, without @user_errors
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort as exc:  # Ctrl-C (click turns KeyboardInterrupt into Abort) or EOF at a prompt
            interrupted = isinstance(exc.__cause__, KeyboardInterrupt)
            click.echo("interrupted" if interrupted else "aborted", err=True)
            sys.exit(130 if interrupted else 1)  # 130: the shell's code for SIGINT
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="infer")
@click.option("--log-json", is_flag=True, help="Log JSON lines instead of console text.")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    default="info",
    show_default=True,
    help="Least severe log records shown.",
)
def cli(log_json: bool, log_level: str) -> None:
    """infer: a plugin-architecture LLM inference engine."""
    from infer.common.log import configure

    configure(json_logs=log_json, level=log_level.lower())


for command in (run, plugins, doctor, bench, models):
    cli.add_command(command)


def main() -> None:
    from infer.core.registry import PluginRegistry

    try:
        registry = PluginRegistry.load(extra_plugins())
        for impl in registry.manager.hook.infer_register_commands.get_hookimpls():
            impl.function(cli)
    except InferError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    cli(prog_name="infer")


if __name__ == "__main__":
    main()
