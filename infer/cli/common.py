"""What every command shares: user errors as one line, and the plugins INFER_EXTRA_PLUGINS names."""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import click

from infer.api.errors import ConfigError, InferError, one_line
from infer.common import env


def user_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Print an InferError as one line on stderr and exit 2; no traceback for user errors."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except InferError as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def extra_plugins() -> list[Any]:
    """Plugins named in INFER_EXTRA_PLUGINS ("module:attr,module2"): unpublished plugins for tests and
    plugin development, read by the CLI only (embedding apps pass `LLM(plugins=[...])`)."""
    found = []
    for item in env.extra_plugins():
        module_name, _, attr = item.partition(":")
        try:
            module = importlib.import_module(module_name)
            found.append(getattr(module, attr) if attr else module)  # the attribute the user named
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"INFER_EXTRA_PLUGINS names {item!r}, which cannot be loaded ({type(exc).__name__}: {exc}): "
                f"fix or unset the variable"
            ) from exc
    return found
