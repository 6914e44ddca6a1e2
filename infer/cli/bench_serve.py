"""`infer bench serve`: an online load generator for any OpenAI-compatible server."""

from __future__ import annotations

from pathlib import Path

import click

from infer.api.errors import ConfigError
from infer.cli.common import user_errors
from infer.cli.options import writable


@click.command("serve")
@click.option(
    "--base-url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="The server's root (its /v1/... paths are added).",
)
@click.option("--model", default=None, help="The `model` of every request (default: the server's first model).")
@click.option("--api-key", default=None, help="Sent as `Authorization: Bearer KEY`.")
@click.option(
    "--workload",
    default="sharegpt-like",
    show_default=True,
    help="random-IxO (e.g. random-1024x128), sharegpt-like, builtin, edit, latency-1, or a JSON/JSONL file.",
)
@click.option(
    "--num-prompts", type=click.IntRange(min=1), default=None, help="Requests per run (default: the workload's)."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Output tokens of every request (default: the workload's).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the workload and the arrival times.")
@click.option(
    "--request-rate",
    "request_rates",
    multiple=True,
    help="Poisson arrivals per second, inf for all at once (default); several (repeated or 1,2,4) make a sweep.",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Requests in flight at most (with a rate: arrivals wait for a slot).",
)
@click.option(
    "--endpoint",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    show_default=True,
    help="/v1/completions (token ids or text) or /v1/chat/completions (text).",
)
@click.option("--goodput", "slos", multiple=True, help="SLOs in ms, e.g. --goodput ttft:200 tpot:50 e2e:5000.")
@click.argument("more_slos", nargs=-1, metavar="[NAME:MS]...")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable,
    default=None,
    help="Write every figure and the settings as JSON.",
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=writable,
    default=None,
    help="Draw latency against request rate (needs matplotlib: pip install 'infer[bench]').",
)
@click.option(
    "--tokenizer",
    default=None,
    help="A tokenizer folder or model on this machine: decodes token-id workloads for chat, sizes the vocabulary.",
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=11),
    default=None,
    help="Random token ids are drawn below it (default: the tokenizer's, else the model's config).",
)
@click.option(
    "--priority-mix",
    default=None,
    metavar="P:W,...",
    help="Send each request a priority drawn with these weights (e.g. 0:1,1:4: a fifth at priority 0, lower "
    "first); the report adds TTFT by priority.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds to wait for each read of a response before the request counts as failed.",
)
@user_errors
def serve(
    base_url: str,
    model: str | None,
    api_key: str | None,
    workload: str,
    num_prompts: int | None,
    max_tokens: int | None,
    seed: int,
    request_rates: tuple[str, ...],
    max_concurrency: int | None,
    endpoint: str,
    slos: tuple[str, ...],
    more_slos: tuple[str, ...],
    json_path: Path | None,
    png_path: Path | None,
    tokenizer: str | None,
    vocab_size: int | None,
    priority_mix: str | None,
    timeout_s: float,
) -> None:
    """Send a workload to an OpenAI-compatible server at each request rate; report TTFT, TPOT, ITL,
    end-to-end and normalized latency percentiles, throughput and goodput."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ConfigError("`infer bench serve` needs httpx: pip install 'infer[bench]'") from None
    from infer.bench.online import LoadSettings, normalize_base_url
    from infer.bench.online_metrics import parse_goodput
    from infer.bench.online_sweep import SweepSettings, parse_priority_mix, parse_rates, run_sweep

    settings = SweepSettings(
        load=LoadSettings(
            base_url=normalize_base_url(base_url),
            model=model or "",
            endpoint="chat" if endpoint == "chat" else "completions",
            api_key=api_key,
            max_concurrency=max_concurrency,
            seed=seed,
            timeout_s=timeout_s,
        ),
        request_rates=parse_rates(request_rates),
        workload=workload,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        slo_ms=parse_goodput([*slos, *more_slos]),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        priority_mix=parse_priority_mix(priority_mix),
    )
    run_sweep(settings, json_path, png_path, click.echo)
