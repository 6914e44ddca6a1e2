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

What one client may ask is bounded by the `ServeLimits` options (`LIMITS_HELP`: --max-request-bytes,
--body-timeout, --header-timeout, --keep-alive-timeout, --max-stop, --max-logit-bias,
--max-schema-bytes, --max-schema-depth, --max-choices, --max-choices-length, --max-regex-length,
--max-grammar-length). --api-key guards every route but /health; --metrics-public leaves /metrics open.

SIGTERM or SIGINT shuts down gracefully (`infer.serve.server`): new requests get a 503, running ones
finish for up to --shutdown-timeout seconds, then each open stream gets an error event and `[DONE]`
(a JSON request a 503), the engines close and their processes exit. A second signal cuts at once.
If an engine's process dies, its requests get 503s (streams: an error event and `[DONE]`), /health
is a 503, /metrics still answers (`infer_engine_up` 0); --restart-engine builds it again in a fresh
process, else the server shuts down so that an orchestrator restarts it. The exit code says how it
ended: 0 every request finished, 4 requests were cut at --shutdown-timeout, 5 an engine died (and
was not restarted); 2 a bad option or model, 3 the address could not be bound (uvicorn's).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

import click

from infer.api.adapters import LoRARequest
from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, RequestError
from infer.api.hookspecs import hookimpl
from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config, engine_options_except
from infer.runtime.builder import make_engine
from infer.serve.limits import ServeLimits, option_name
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


def lora_modules(specs: tuple[str, ...], served: list[str]) -> dict[str, list[LoRARequest]]:
    """--lora-modules NAME=PATH (or vLLM's JSON form, {"name", "path", "base_model_name"}) -> the adapters of
    each served model, ids 1, 2, ... in order."""
    found: dict[str, list[LoRARequest]] = {}
    names: set[str] = set()
    for i, spec in enumerate(specs, start=1):
        base = None
        if spec.lstrip().startswith("{"):
            try:
                item = json.loads(spec)
                name, path, base = item["name"], item["path"], item.get("base_model_name")
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f"--lora-modules {spec!r}: write NAME=PATH, or JSON with name, path and base_model_name"
                ) from None
        else:
            name, eq, path = spec.partition("=")
            if not eq:
                raise ConfigError(f"--lora-modules {spec!r}: write NAME=PATH (the adapter's name and its folder)")
        name, path = str(name).strip(), str(path).strip()
        if not name or not path:
            raise ConfigError(f"--lora-modules {spec!r}: both the name and the folder are needed: NAME=PATH")
        if base is None:
            if len(served) > 1:
                raise ConfigError(
                    f"--lora-modules {spec!r}: {len(served)} models are served; say which one it adapts with the JSON "
                    f'form, {{"name": "{name}", "path": "{path}", "base_model_name": "{served[0]}"}}'
                )
            base = served[0]
        if base not in served:
            raise ConfigError(
                f"--lora-modules {spec!r}: base model {base!r} is not served: use one of {', '.join(served)}"
            )
        if name in names or name in served:
            raise ConfigError(f"--lora-modules {spec!r}: the name {name!r} is taken already: give it another")
        names.add(name)
        found.setdefault(base, []).append(LoRARequest(name, i, path))
    return found


LIMITS_HELP = {  # ServeLimits field -> its option's help
    "max_request_bytes": "A request body past this many bytes is a 413 (by Content-Length, or counted as it arrives).",
    "body_timeout_s": "Seconds a request body may go without a byte (or stop short of its Content-Length): a 408.",
    "header_timeout_s": "Seconds a connection may hold a request's partial headers before it is closed.",
    "keep_alive_timeout_s": "Seconds an idle keep-alive connection stays open.",
    "max_stop": "Stop strings per request, at most.",
    "max_logit_bias": "logit_bias entries per request, at most.",
    "max_schema_bytes": "A JSON schema's size as JSON text, at most (response_format, guided_json, tool parameters).",
    "max_schema_depth": "A JSON schema's nesting depth (objects and arrays inside each other), at most.",
    "max_choices": "guided_choice strings per request, at most.",
    "max_choices_length": "guided_choice strings' characters, all together, at most.",
    "max_regex_length": "A guided_regex's characters, at most.",
    "max_grammar_length": "A guided_grammar's characters, at most.",
}


def limit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One option per ServeLimits field (LIMITS_HELP), handed to `command` together as `limits`."""
    names = {option_name(f.name): f.name for f in dataclasses.fields(ServeLimits)}
    defaults = {f.name: f.default for f in dataclasses.fields(ServeLimits)}

    @functools.wraps(command)
    def with_limits(**kwargs: Any) -> Any:
        limits = ServeLimits(**{name: kwargs.pop(name) for name in names.values()})
        return command(limits=limits, **kwargs)

    for option, name in reversed(names.items()):
        default = defaults[name]
        kind = click.FloatRange(min=0, min_open=True) if isinstance(default, float) else click.IntRange(min=1)
        help_text = LIMITS_HELP[name]
        with_limits = click.option(option, name, type=kind, default=default, show_default=True, help=help_text)(
            with_limits
        )
    return with_limits


@click.command()
@click.argument("model_arg", metavar="[MODEL]", required=False)
@click.option(
    "--served-model-name",
    default=None,
    metavar="NAME",
    help="The name requests use for the one model served (vLLM's flag; several models: --model MODEL:name=NAME).",
)
@click.option("--disable-log-requests", is_flag=True, help="No access-log line per request (vLLM's flag).")
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="MODEL[:FIELD=VALUE,...]",
    help="A model to serve (repeatable), with options of its engine only, e.g. "
    "'llama3-8b:load_format=dummy,attention=torch,name=llama'. [default: smollm2-135m]",
)
@engine_options_except("model", "max_step_ms")
@click.option(
    "--max-step-ms",
    "max_step_ms",
    type=click.FloatRange(min=0, min_open=True),
    default=500.0,
    show_default=True,
    help="A step's target time in ms: the per-step token budget (at most --max-num-batched-tokens) shrinks to "
    "what the device computes in it, measured as it serves, so one long prompt cannot freeze the other streams.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option(
    "--api-key",
    default=None,
    help="Require 'Authorization: Bearer KEY' on every route but /health (/metrics too, unless --metrics-public).",
)
@click.option("--metrics-public", is_flag=True, help="With --api-key, serve /metrics without the key (to a scraper).")
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
@click.option(
    "--reasoning-parser",
    default=None,
    metavar="NAME",
    help="Split each chat's reasoning (reasoning_content) from its answer: a reasoning_parser plugin "
    "(qwen3, deepseek-r1, or one `infer plugins` lists). Without it the reasoning stays in the content.",
)
@click.option(
    "--otlp-traces-endpoint",
    default=None,
    metavar="URL",
    help="Send an OpenTelemetry span per request to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318/v1/traces; "
    "pip install 'infer[otel]').",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM or SIGINT, seconds the running requests may take to finish (new ones get a 503); then "
    "each open stream ends with an error event and [DONE], and the exit code is 4 (0 when all finished).",
)
@click.option(
    "--restart-engine",
    is_flag=True,
    help="When an engine's process dies, build it again (its requests get 503s meanwhile); without it the "
    "server shuts down and exits with code 5, for an orchestrator to restart.",
)
@click.option(
    "--data-parallel-size",
    "-dp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Replicas of each model, each an engine in a process of its own (with its own --tp ranks and "
    "devices), behind one router: a request goes to the replica that holds its prompt's prefix, else to the "
    "least loaded; a replica that dies takes no new request and what it had is retried on another.",
)
@click.option(
    "--distributed-executor-backend",
    type=click.Choice(["mp", "ray"]),
    default="mp",
    show_default=True,
    help="What starts each engine's process: mp, a child of this one; ray, a Ray actor placed on a local Ray or "
    "a cluster's nodes (--ray-address; pip install 'infer[ray]'), one placement group per engine.",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDRESS",
    help="The Ray cluster to place engines on (e.g. ray://head:10001 or head:6379); default: RAY_ADDRESS, else "
    "a local Ray started here.",
)
@click.option(
    "--api-server-count",
    "-asc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="API server processes (vLLM's flag), each accepting on the same port and reaching every engine: HTTP "
    "parsing and answering spread over cores, so requests (high priority ones too) do not queue behind one event "
    "loop at hundreds a second.",
)
@click.option(
    "--lora-modules",
    "lora_specs",
    multiple=True,
    metavar="NAME=PATH",
    help="A LoRA adapter (PEFT folder) served as model NAME (repeatable; with several --model, the JSON form "
    '{"name": ..., "path": ..., "base_model_name": ...}). Turns on --enable-lora for its base model.',
)
@click.option(
    "--allow-runtime-lora-updating",
    is_flag=True,
    help="Answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); off: a 404.",
)
@limit_options
@user_errors
def serve(
    model_arg: str | None,
    served_model_name: str | None,
    disable_log_requests: bool,
    models: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    metrics_public: bool,
    max_waiting: int | None,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    otlp_traces_endpoint: str | None,
    shutdown_timeout: float,
    restart_engine: bool,
    data_parallel_size: int,
    distributed_executor_backend: str,
    ray_address: str | None,
    api_server_count: int,
    lora_specs: tuple[str, ...],
    allow_runtime_lora_updating: bool,
    limits: ServeLimits,
    **engine_opts: Any,
) -> None:
    """Serve models over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /metrics.

    SIGTERM or SIGINT drains (--shutdown-timeout); an engine process that dies is built again
    (--restart-engine) or the server shuts down. Exit codes: 0 every request finished, 4 requests were
    cut at --shutdown-timeout, 5 an engine died and was not restarted.
    """
    try:
        import uvicorn

        from infer.serve.app import create_app
        from infer.serve.http_limits import uvicorn_options
        from infer.serve.lifecycle import Lifecycle
        from infer.serve.server import Server
    except ImportError as exc:
        raise ConfigError(f"infer serve needs the serve extra ({exc.name} is missing): {EXTRA}") from None
    from infer.serve.async_engine import AsyncEngine
    from infer.serve.replicas import ReplicatedEngine, replica_devices

    if reasoning_parser is not None:  # an unknown name fails now, before any model loads
        from infer.core.registry import PluginRegistry

        PluginRegistry.load().get("reasoning_parser", reasoning_parser)
    tracer = None
    if otlp_traces_endpoint is not None:  # checked (the extra installed) before any model loads
        from infer.serve.tracing import otlp_tracer

        tracer = otlp_tracer(otlp_traces_endpoint)
    if model_arg is not None:  # `infer serve MODEL`, as `vllm serve MODEL`
        models = (model_arg, *models)
    configs = model_configs(models, engine_opts)
    if served_model_name is not None:
        if len(configs) != 1:
            raise ConfigError(
                f"--served-model-name names one model and {len(configs)} are served: give each its name with "
                f"--model MODEL:name=NAME"
            )
        if not served_model_name.strip():
            raise ConfigError("--served-model-name is empty: give the name requests should use")
        configs = {served_model_name.strip(): next(iter(configs.values()))}
    if api_server_count > 1:
        _check_fronts(restart_engine, distributed_executor_backend, allow_runtime_lora_updating)
    loras = lora_modules(lora_specs, list(configs))
    for name in loras:  # a model with adapters serves them
        configs[name] = configs[name].replace(enable_lora=True)
    engines: dict[str, AsyncEngine | ReplicatedEngine] = {}
    exit_code = 0
    try:
        for name, config in configs.items():
            click.echo(f"loading {name} ({config.model})", err=True)
            # each engine steps in a process of its own: the event loop here never holds the GIL its steps need
            build = functools.partial(_build_engine, config, tuple(loras.get(name, ())))
            on_gpu = config.resolve_device().type == "cuda"
            start = None
            if distributed_executor_backend == "ray":
                from infer.serve.ray_executor import RayStarter

                start = RayStarter(ray_address, gpus=config.world_size if on_gpu else 0)
            elif ray_address is not None:
                raise ConfigError("--ray-address places engines with Ray: add --distributed-executor-backend ray")
            if data_parallel_size > 1:
                devices = None  # Ray gives each actor its own GPUs
                if on_gpu and start is None:
                    devices = replica_devices(data_parallel_size, config.world_size)
                engines[name] = ReplicatedEngine.spawn(build, data_parallel_size, max_waiting, devices, start)
            else:
                engines[name] = AsyncEngine.spawn(build, max_waiting=max_waiting, start=start)
        app_options = {
            "api_key": api_key,
            "tool_call_parser": tool_call_parser,
            "reasoning_parser": reasoning_parser,
            "limits": limits,
            "metrics_public": metrics_public,
            "adapters": loras,
            "allow_adapter_updates": allow_runtime_lora_updating,
        }
        # the Server drains before uvicorn's own shutdown: what is left for it after the cut is cancelled
        server_options = {
            "host": host,
            "port": port,
            "log_level": "info",
            "timeout_graceful_shutdown": 5,
            "access_log": not disable_log_requests,
            **uvicorn_options(limits),
        }
        fronts = f" by {api_server_count} API server processes" if api_server_count > 1 else ""
        click.echo(f"serving {', '.join(engines)} at http://{host}:{port}/v1{fronts}", err=True)
        if api_server_count > 1:
            from infer.serve.fronts import serve_fronts

            exit_code = serve_fronts(
                api_server_count, engines, app_options, server_options, shutdown_timeout, max_waiting,
                otlp_traces_endpoint,
            )  # fmt: skip
        else:
            lifecycle = Lifecycle()
            app = create_app(engines, tracer=tracer, lifecycle=lifecycle, **app_options)
            server = Server(uvicorn.Config(app, **server_options), engines, lifecycle, shutdown_timeout, restart_engine)
            server.run()
            exit_code = server.exit_code
    finally:
        for engine in engines.values():
            engine.close()
    if exit_code:
        sys.exit(exit_code)


def _check_fronts(restart_engine: bool, backend: str, runtime_adapters: bool) -> None:
    """What several API server processes cannot do yet, refused before any model loads."""
    why = None
    if restart_engine:
        why = "--restart-engine (each API server process holds its own connections to an engine)"
    elif backend == "ray":
        why = "--distributed-executor-backend ray (the API servers reach engines over local pipes)"
    elif runtime_adapters:
        why = "--allow-runtime-lora-updating (each API server process keeps its own list of served adapters)"
    if why is not None:
        raise ConfigError(f"--api-server-count above 1 does not go with {why}: drop one of the two")


def _build_engine(config: EngineConfig, loras: tuple[LoRARequest, ...] = ()) -> Any:
    """Runs in the engine's process: the plugins INFER_EXTRA_PLUGINS names are found there too; the
    adapters of --lora-modules are read there (a bad one stops the server before it serves)."""
    from infer.distributed.launch import launch
    from infer.serve.warm_up import warm_up

    engine = make_engine(config, extra_plugins(), launch=launch)
    try:
        for lora in loras:
            try:
                engine.add_adapter(lora)
            except RequestError as exc:
                raise ConfigError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {exc}") from None
        click.echo("warming up: a few prompts compile the first prefill shapes' kernels", err=True)
        click.echo(f"warmed up in {warm_up(engine):.1f}s", err=True)
    except BaseException:
        engine.close()
        raise
    return engine


@hookimpl
def infer_register_commands(cli: click.Group) -> None:
    cli.add_command(serve)
