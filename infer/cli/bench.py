"""`infer bench`: every valid combination of the --matrix axes over one workload, beside HF baselines
(`infer bench matrix`, the default), `infer bench accuracy`, what lossy configurations cost in
perplexity and greedy agreement, and `infer bench serve`, the online load generator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from infer.cli.bench_serve import serve
from infer.cli.common import extra_plugins, user_errors
from infer.cli.options import engine_config, engine_options, writable


class BenchGroup(click.Group):
    """A group whose first command is the default: `infer bench --matrix ...` is `infer bench matrix --matrix ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [next(iter(self.commands)), *args]
        return super().parse_args(ctx, args)


@click.command("matrix")
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
    callback=writable,
    default=None,
    help="Write every run as JSON.",
)
@click.option(
    "--chart",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable,
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
def matrix_command(
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
        engine_config(engine_opts),
        [*matrix, *axes],
        [b for s in baselines for b in s.split(",") if b],
        dataset,
        num_prompts,
        max_tokens,
        json_out,
        chart,
        extra_plugins(),
        repeat,
    )


@click.command("accuracy")
@engine_options
@click.option(
    "--compare",
    "compares",
    multiple=True,
    help="A lossy configuration measured against the baseline (the engine options): FIELD=VALUE[,FIELD=VALUE] "
    "(repeatable). Default: quantization=fp8, kv_cache_dtype=fp8, and both.",
)
@click.option("--windows", type=click.IntRange(min=1), default=16, show_default=True, help="Perplexity windows.")
@click.option(
    "--window-tokens",
    type=click.IntRange(min=2),
    default=512,
    show_default=True,
    help="Tokens per window; each after the first is scored given those before it in its window.",
)
@click.option("--prompts", type=click.IntRange(min=1), default=64, show_default=True, help="Greedy prompts.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True, help="Tokens per prompt.")
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Greedy tokens per prompt."
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable,
    default=None,
    help="Write the figures as JSON.",
)
@user_errors
def accuracy_command(
    compares: tuple[str, ...],
    windows: int,
    window_tokens: int,
    prompts: int,
    prompt_tokens: int,
    max_tokens: int,
    json_out: Path | None,
    **engine_opts: Any,
) -> None:
    """Perplexity and greedy agreement of lossy configurations (FP8 weights, an FP8 KV cache) against the
    baseline the engine options describe, on chats of the chitchat-dataset package."""
    from infer.bench.accuracy import run_accuracy

    sizes = dict(
        windows=windows,
        window_tokens=window_tokens,
        prompts=prompts,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )
    run_accuracy(engine_config(engine_opts), list(compares), sizes, json_out, extra_plugins())


@click.group(cls=BenchGroup)
def bench() -> None:
    """Benchmarks: strategy combinations in one process (matrix, the default), the accuracy of lossy
    configurations (accuracy), or a server online (serve)."""


bench.add_command(matrix_command)
bench.add_command(accuracy_command)
bench.add_command(serve)
