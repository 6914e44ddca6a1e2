"""`infer run`: a workload through one engine (and an optional baseline variant), throughput printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError
from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config, engine_options, writable


def parse_baseline(spec: str) -> dict[str, Any]:
    """ "scheduler=static,num_kv_blocks=64" -> typed EngineConfig changes (each value by its field's type)."""
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


@click.command()
@engine_options
@click.option(
    "--dataset",
    default="builtin",
    show_default=True,
    help="builtin, edit, random-256x256 (any random-IxO), sharegpt-like, latency-1, chat, or a JSON/JSONL file.",
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
    callback=writable,
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
@click.option(
    "--warm-up/--no-warm-up",
    "warm_up",
    default=None,
    help="Before the timed run, run its first 32 prompts' lengths on random token ids of their own (no measured "
    "prompt enters the prefix cache) for 4 tokens, so that no kernel compiles inside it (default: on a GPU).",
)
@click.option("--profile", is_flag=True, help="Time each component of the decode steps and print the breakdown.")
@click.option(
    "--profile-chart",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable,
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
    warm_up: bool | None,
    profile: bool,
    profile_chart: Path | None,
    **engine_opts: Any,
) -> None:
    """Run a workload and print throughput (and a few generations)."""
    from infer.bench.runner import run_command

    run_command(
        config=engine_config(engine_opts),
        dataset=dataset,
        prompts=list(prompts),
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        baseline=parse_baseline(baseline) if baseline else None,
        json_out=json_out,
        show=show,
        progress=("bar" if sys.stderr.isatty() else "lines") if progress is None else ("bar" if progress else "off"),
        extra_plugins=extra_plugins(),
        profile=profile,
        profile_chart=profile_chart,
        n=n,
        beam_width=beam_width,
        length_penalty=length_penalty,
        warm_up=warm_up,
    )
