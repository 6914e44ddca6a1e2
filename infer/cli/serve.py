"""`infer serve`: an OpenAI-compatible server, one engine per --model (needs `pip install 'infer[serve]'`).

A built-in plugin: its entry point registers the command through `infer_register_commands`, as a
third-party command would be. Importing it imports no server library; running it without the extra
stops with one line naming the install.

    infer serve                                              # smollm2-135m on 127.0.0.1:8000
    infer serve --model smollm2-135m --model 'llama3-8b:load_format=dummy,attention=torch,name=llama'
    infer serve --model Qwen/Qwen2.5-7B-Instruct --tool-call-parser hermes   # tool_choice "auto" reads its calls

A --model is MODEL[:FIELD=VALUE,...]: the model as `infer run --model` takes it, then options of its
engine only (any engine option's field name: attention, num_kv_blocks, ...; `name` is the id requests
use, default MODEL). The engine options given as flags apply to every model; a model's own override them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import click

from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config, engine_options_except
from infer.core.config import EngineConfig
from infer.core.errors import ConfigError
from infer.core.hookspecs import hookimpl
from infer.serve.tool_parsers import PARSERS

EXTRA = "pip install 'infer[serve]'"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One --model: the name requests route by, and its engine's option changes."""

    name: str  # what requests put in `model` (and /v1/models lists)
    changes: dict[str, Any]  # EngineConfig field -> typed value, model included


def parse_model(spec: str) -> ModelSpec:
    """ "llama3-8b:load_format=dummy,attention=torch" -> ModelSpec("llama3-8b", {model, load_format, attention})."""
    model, sep, rest = spec.partition(":")
    if not sep or "=" not in rest:  # no options (a folder's path may hold a colon)
        model, rest = spec, ""
    model = model.strip()
    if not model:
        raise ConfigError(f"--model {spec!r} names no model: write MODEL or MODEL:FIELD=VALUE,...")
    changes: dict[str, Any] = {"model": model}
    name = model
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ConfigError(f"--model {spec!r}: write its options as FIELD=VALUE pairs, e.g. {model}:attention=torch")
        if key == "name":
            name = value.strip()
            continue
        if key == "model":
            raise ConfigError(f"--model {spec!r}: the model comes before the colon; drop model={value}")
        changes[key] = EngineConfig.parse_option(key, value, f"--model {spec!r}")
    if not name:
        raise ConfigError(f"--model {spec!r}: name= is empty; give the id requests should use")
    return ModelSpec(name, changes)


def model_configs(specs: tuple[str, ...], shared: dict[str, Any]) -> dict[str, EngineConfig]:
    """Served name -> its EngineConfig (the shared flags, then the model's own options), checked."""
    configs: dict[str, EngineConfig] = {}
    for spec in specs or (EngineConfig().model,):
        model = parse_model(spec)
        if model.name in configs:
            raise ConfigError(f"two --model options are served as {model.name!r}: give one of them name=OTHER")
        config = engine_config(shared).replace(**model.changes)
        config.validate()
        configs[model.name] = config
    return configs


@click.command()
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="MODEL[:FIELD=VALUE,...]",
    help="A model to serve (repeatable), with options of its engine only, e.g. "
    "'llama3-8b:load_format=dummy,attention=torch,name=llama'. [default: smollm2-135m]",
)
@engine_options_except("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/* and /(de)tokenize.")
@click.option(
    "--max-waiting",
    type=click.IntRange(min=0),
    default=None,
    help="Per model, requests accepted but not started, at most; more get a 429 (default: no limit).",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(sorted(PARSERS)),
    default=None,
    help="The format of the tool calls models write (hermes: Hermes, Qwen 2.5 and 3; llama3_json: Llama 3.1+), "
    "read for chats with tool_choice 'auto'. Without it such chats are refused.",
)
@user_errors
def serve(
    models: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    max_waiting: int | None,
    tool_call_parser: str | None,
    **engine_opts: Any,
) -> None:
    """Serve models over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /metrics."""
    try:
        import uvicorn

        from infer.serve.app import create_app
    except ImportError as exc:
        raise ConfigError(f"infer serve needs the serve extra ({exc.name} is missing): {EXTRA}") from None
    from infer.serve.async_engine import AsyncEngine

    configs = model_configs(models, engine_opts)
    engines: dict[str, AsyncEngine] = {}
    try:
        for name, config in configs.items():
            click.echo(f"loading {name} ({config.model})", err=True)
            # each engine steps in a process of its own: the event loop here never holds the GIL its steps need
            engines[name] = AsyncEngine.spawn(functools.partial(_build_engine, config), max_waiting=max_waiting)
        app = create_app(engines, api_key=api_key, tool_call_parser=tool_call_parser)
        click.echo(f"serving {', '.join(engines)} at http://{host}:{port}/v1", err=True)
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        for engine in engines.values():
            engine.close()


def _build_engine(config: EngineConfig) -> Any:
    """Runs in the engine's process: the plugins INFER_EXTRA_PLUGINS names are found there too."""
    from infer.core.engine import Engine
    from infer.distributed.launch import launch
    from infer.serve.warm_up import warm_up

    engine = Engine.from_config(config, extra_plugins(), launch=launch)
    try:
        click.echo(f"warmed up in {warm_up(engine):.1f}s (the first prefill shapes' kernels compiled)", err=True)
    except BaseException:
        engine.close()
        raise
    return engine


@hookimpl
def infer_register_commands(cli: click.Group) -> None:
    cli.add_command(serve)
