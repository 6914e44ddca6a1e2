"""`infer bench serve`: a workload sent to an OpenAI-compatible server once per request rate of a
sweep; a table row per rate, a JSON record of every figure, latency against rate as a PNG."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from infer.api.errors import ConfigError, InferError, one_line
from infer.bench.online import (
    Endpoint,
    LoadResult,
    LoadSettings,
    OnlineRequest,
    RequestRecord,
    ServerError,
    check_server,
    run_load,
)
from infer.bench.online_metrics import (
    detail_table,
    lag_warning,
    priority_table,
    rate_text,
    request_figures,
    summarize,
    sweep_table,
)
from infer.bench.workloads import Workload, load_workload, needs_vocab


@dataclass(frozen=True, slots=True)
class SweepSettings:
    load: LoadSettings  # server, model (may be "" until the server is asked), endpoint, concurrency, seed
    request_rates: tuple[float, ...]  # one run of the whole workload per rate, in this order
    workload: str  # a workload name (random-IxO, sharegpt-like, ...) or a JSON/JSONL file
    num_prompts: int | None = None  # None: the workload's own count
    max_tokens: int | None = None  # None: the workload's output lengths
    slo_ms: dict[str, float] = field(default_factory=dict)  # --goodput bounds: ttft/tpot/e2e -> ms
    tokenizer: str | None = None  # a folder or model name whose tokenizer decodes ids for chat, sizes the vocabulary
    vocab_size: int | None = None  # bound for random token ids; None: from the tokenizer or the model's config
    # --priority-mix: (priority, weight) pairs; each request draws its priority with these weights (seeded)
    priority_mix: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Progress:
    """on_done for run_load: a line on stderr every `interval_s`, and when the run is done."""

    label: str
    total: int  # requests in the run
    echo: Callable[[str], None]
    interval_s: float = 5.0
    done: int = 0
    failed: int = 0
    started: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += record.error is not None
        now = time.perf_counter()
        if now - self.last >= self.interval_s or self.done == self.total:
            self.last = now
            failed = f", {self.failed} failed" if self.failed else ""
            self.echo(f"{self.label}: {self.done}/{self.total} requests{failed}, {now - self.started:.1f}s")


def local_tokenizer(name: str) -> Any:
    """The tokenizer in a folder, or of a model on this machine (infer's cache, the HF cache); never downloads."""
    from infer.core.registry import PluginRegistry
    from infer.loading.loader import load_tokenizer, resolve_source

    folder = Path(name).expanduser()
    path = folder if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file() else None
    if path is None:
        path = resolve_source(name, PluginRegistry.load(), "dummy", pull=False).tokenizer_path
    if path is None:
        raise ConfigError(
            f"--tokenizer {name}: no tokenizer files on this machine: point it at a folder with tokenizer.json, "
            f"or pull the model (`infer models pull NAME`)"
        )
    return load_tokenizer(path)


def vocabulary_size(settings: SweepSettings, tokenizer: Any | None) -> int:
    """Random token ids are drawn below this: --vocab-size, else the tokenizer's, else the model's config."""
    if settings.vocab_size is not None:
        return settings.vocab_size
    if tokenizer is not None:
        return len(tokenizer)
    from infer.core.registry import PluginRegistry
    from infer.loading.loader import load_tokenizer, resolve_source

    try:
        source = resolve_source(settings.load.model, PluginRegistry.load(), "dummy", pull=False)
    except InferError:
        raise ConfigError(
            f"the {settings.workload} workload draws token ids below the model's vocabulary, and model "
            f"{settings.load.model!r} is not on this machine: pass --tokenizer PATH or --vocab-size N"
        ) from None
    size = int(source.hf_config["vocab_size"])
    local = load_tokenizer(source.tokenizer_path)
    return min(size, len(local)) if local is not None else size


def online_requests(workload: Workload, endpoint: Endpoint, tokenizer: Any | None) -> list[OnlineRequest]:
    """Token ids go as they are to /v1/completions; chat messages are text, so ids are decoded for chat."""
    requests = []
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
        if isinstance(prompt, list):
            if endpoint == "chat":
                if tokenizer is None:
                    raise ConfigError(
                        f"the {workload.name} workload is token ids and chat messages are text: pass --tokenizer "
                        f"to decode them, or use --endpoint completions"
                    )
                requests.append(OnlineRequest(tokenizer.decode(prompt), max_tokens, len(prompt)))
            else:
                requests.append(OnlineRequest(prompt, max_tokens, len(prompt)))
            continue
        if not prompt.strip():
            raise ConfigError(f"prompt {i} of {workload.name} is empty: fix the workload")
        known = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else 0
        requests.append(OnlineRequest(prompt, max_tokens, known))
    return requests


def with_priorities(
    requests: list[OnlineRequest], mix: tuple[tuple[int, float], ...], seed: int
) -> list[OnlineRequest]:
    """Each request's priority drawn from `mix` ((priority, weight) pairs), the same for the same seed."""
    if not mix:
        return requests
    draw = random.Random(seed ^ 0x5EED)
    levels, weights = [p for p, _ in mix], [w for _, w in mix]
    return [replace(r, priority=draw.choices(levels, weights)[0]) for r in requests]


def parse_priority_mix(text: str | None) -> tuple[tuple[int, float], ...]:
    """'0:1,1:4' -> ((0, 1.0), (1, 4.0)): priorities and their weights; a ConfigError names the fix."""
    if not text:
        return ()
    mix = []
    for part in text.split(","):
        level, sep, weight = part.partition(":")
        try:
            pair = (int(level), float(weight) if sep else 1.0)
        except ValueError:
            pair = None
        if pair is None or not (pair[1] > 0 and math.isfinite(pair[1])):
            raise ConfigError(
                f"--priority-mix {text!r}: write PRIORITY:WEIGHT pairs, e.g. 0:1,1:4 (a fifth at priority 0)"
            )
        mix.append(pair)
    return tuple(mix)


def choose_model(settings: LoadSettings, served: list[str]) -> str:
    """--model, checked against the server's list; else the server's first model."""
    if not served:
        raise ServerError(f"{settings.base_url} serves no model (GET /v1/models is empty): start it with a model")
    if not settings.model:
        return served[0]
    if settings.model not in served:
        raise ServerError(
            f"model {settings.model!r} is not served at {settings.base_url}: pass --model with one of {', '.join(served)}"
        )
    return settings.model


def _record(settings: SweepSettings, workload: Workload, runs: list[tuple[dict[str, Any], LoadResult]]) -> dict:
    load = asdict(settings.load)
    load.pop("api_key")  # a secret: never written
    load["request_rate"] = [rate_text(r) for r in settings.request_rates]
    return {
        "command": "infer bench serve",
        "settings": {
            **load,
            "workload": workload.name,
            "num_prompts": len(workload.prompts),
            "max_tokens": settings.max_tokens,
            "slo_ms": settings.slo_ms,
            "tokenizer": settings.tokenizer,
            "vocab_size": settings.vocab_size,
            "priority_mix": [list(pair) for pair in settings.priority_mix],
        },
        "runs": [{**summary, "requests": [request_figures(r) for r in result.records]} for summary, result in runs],
    }


def run_sweep(
    settings: SweepSettings, json_path: Path | None, png_path: Path | None, echo: Callable[..., None]
) -> list[dict[str, Any]]:
    """Every rate of the sweep in turn; the per-rate summaries. `echo(text, err=False)` prints."""
    if png_path is not None:
        try:
            import matplotlib  # noqa: F401  (checked before the sweep, not after it)
        except ImportError:
            raise ConfigError("--png needs matplotlib: pip install 'infer[bench]'") from None
    load = replace(settings.load, model=choose_model(settings.load, asyncio.run(check_server(settings.load))))
    settings = replace(settings, load=load)
    tokenizer = local_tokenizer(settings.tokenizer) if settings.tokenizer else None
    vocab = vocabulary_size(settings, tokenizer) if needs_vocab(settings.workload) else 0
    workload = load_workload(settings.workload, vocab, settings.num_prompts, settings.max_tokens, load.seed)
    requests = with_priorities(online_requests(workload, load.endpoint, tokenizer), settings.priority_mix, load.seed)
    runs: list[tuple[dict[str, Any], LoadResult]] = []
    for rate in settings.request_rates:
        label = f"rate {rate_text(rate)}" + (f", concurrency {load.max_concurrency}" if load.max_concurrency else "")
        echo(f"{label}: {len(requests)} requests of {workload.name} to {load.url()} ({load.model})", err=True)
        progress = Progress(label, len(requests), lambda text: echo(text, err=True))
        result = asyncio.run(run_load(requests, replace(load, request_rate=rate), on_done=progress))
        runs.append((summarize(result, settings.slo_ms), result))
    summaries = [summary for summary, _ in runs]
    echo(sweep_table(summaries))
    if len(summaries) == 1:
        echo(detail_table(summaries[0]))
    for summary in summaries:
        table = priority_table(summary)
        if table is not None:
            echo(f"rate {summary['request_rate']}, TTFT by priority (lower runs first):\n{table}")
    for summary in summaries:
        if (warning := lag_warning(summary)) is not None:
            echo(warning, err=True)
        for message, count in summary["errors"].items():
            echo(f"rate {summary['request_rate']}: {count} failed: {message}", err=True)
    if json_path is not None:
        json_path.write_text(json.dumps(_record(settings, workload, runs), indent=2) + "\n")
        echo(f"wrote {json_path}")
    if png_path is not None:
        from infer.bench.charts import serve_sweep_chart

        title = f"{load.model} at {load.base_url}: {workload.name}, {len(requests)} requests per rate"
        problem = serve_sweep_chart(summaries, png_path, title)
        echo(problem if problem is not None else f"wrote {png_path}", err=problem is not None)
    if not any(s["completed"] for s in summaries):
        first = next(iter(summaries[0]["errors"]), "no answer")
        raise ServerError(f"every request failed ({one_line(first)}): check the server's log and the options above")
    return summaries


def parse_rates(items: tuple[str, ...]) -> tuple[float, ...]:
    """`--request-rate 1 --request-rate 2,4,inf` -> (1.0, 2.0, 4.0, inf)."""
    rates = []
    for item in (part.strip() for text in items for part in text.split(",")):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise ConfigError(
                f"--request-rate {item!r} is not a rate: write requests per second (> 0) or inf, "
                f"e.g. --request-rate 1,2,4,inf"
            )
        rates.append(rate)
    return tuple(rates) or (math.inf,)
