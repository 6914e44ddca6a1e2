"""`infer run`: build the engine(s), run the workload, print the table, write JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import click

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, RequestError
from infer.api.request import RequestOutput, SamplingParams
from infer.bench.profiler import StepProfiler, format_profile
from infer.bench.progress import ProgressLines, ProgressMode, progress
from infer.bench.report import RunRecord, format_table, run_workload, warm_up_shaped
from infer.bench.workloads import Workload, load_workload, needs_vocab
from infer.distributed.launch import launch
from infer.inputs.prompts import check_text
from infer.runtime.builder import make_engine


def _label(config: EngineConfig, base: EngineConfig | None) -> str:
    if base is None:
        return "infer"
    diff = {k: v for k, v in config.to_dict().items() if base.to_dict()[k] != v}
    return ",".join(f"{k}={v}" for k, v in diff.items()) or "infer"


LARGE_WORKLOAD = 64  # prompts: preparing them (tokenizing, drawing ids) is announced on stderr


def _run_one(
    config: EngineConfig,
    workload: Workload | None,
    workload_args: dict[str, Any],
    params: SamplingParams,
    label: str,
    mode: ProgressMode,
    extra_plugins: Sequence[Any] = (),
    profile: bool = False,
    warm_up: bool | None = None,
) -> tuple[RunRecord, list[RequestOutput], Workload, dict[str, Any] | None]:
    """workload: None for the workloads drawn from the model's vocabulary, built once the engine is."""
    started = time.perf_counter()
    engine = make_engine(config, extra_plugins, launch)
    build_s = time.perf_counter() - started
    profiler = None
    try:
        if workload is None:
            workload = load_workload(vocab_size=engine.parts.vocab_size, **workload_args)
        warm = None
        if warm_up if warm_up is not None else config.resolve_device().type == "cuda":
            warm = warm_up_shaped(engine, workload, params)
            if mode != "off":
                click.echo(f"{label}: built in {build_s:.1f} s ({phases_text(engine)}), warmed up in {warm[0]:.1f} s on "
                           f"{warm[1]} prompts of its own", err=True)  # fmt: skip
        profiler = StepProfiler.install(engine) if profile else None
        if mode != "off" and len(workload.prompts) >= LARGE_WORKLOAD:
            click.echo(f"preparing {workload.name}: {len(workload.prompts)} prompts", err=True)
        with progress(mode, label, len(workload.prompts)) as on_finish:
            on_step = on_finish.tick if isinstance(on_finish, ProgressLines) else None
            record, outputs = run_workload(engine, workload, params, label, on_finish=on_finish, on_step=on_step)
        record.build_s, record.warm_up_s = build_s, None if warm is None else warm[0]
        record.build_phases = engine.parts.build_phases
        return record, outputs, workload, profiler.summary() if profiler is not None else None
    finally:
        engine.close()


def run_command(
    config: EngineConfig,
    dataset: str,
    prompts: list[str],
    num_prompts: int | None,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    baseline: dict[str, Any] | None,
    json_out: Path | None,
    show: int,
    progress: ProgressMode,
    extra_plugins: Sequence[Any] = (),
    profile: bool = False,
    profile_chart: Path | None = None,
    n: int = 1,
    beam_width: int | None = None,
    length_penalty: float = 1.0,
    warm_up: bool | None = None,
) -> None:
    # Everything the user wrote is checked before the first engine is built (and its weights read).
    config.validate()
    base_config = config.replace(**baseline) if baseline is not None else None
    if base_config is not None:
        base_config.validate()
    params = _sampling_params(config, max_tokens, temperature, top_p, top_k, n, beam_width, length_penalty)
    workload_args = dict(name=dataset, num_prompts=num_prompts, max_tokens=max_tokens, seed=config.seed)
    workload = _early_workload(prompts, dataset, workload_args, params)
    records: list[RunRecord] = []
    if base_config is not None:
        label = "baseline: " + _label(base_config, config)
        records.append(
            _run_one(base_config, workload, workload_args, params, label, progress, extra_plugins, warm_up=warm_up)[0]
        )
    record, outputs, workload, profiled = _run_one(
        config,
        workload,
        workload_args,
        params,
        "infer",
        progress,
        extra_plugins,
        profile or profile_chart is not None,
        warm_up,
    )
    if baseline is not None:
        record.speedup = record.total_tokens_per_s / records[0].total_tokens_per_s
    records.append(record)
    _print_generations(workload, outputs, show)
    _print_run(config, record)
    click.echo(format_table(records))
    if profiled is not None:
        _report_profile(profiled, record, profile_chart)
    if json_out is not None:
        written: dict[str, Any] = {"records": [r.to_dict() for r in records]}
        if profiled is not None:
            written["profile"] = profiled
        json_out.write_text(json.dumps(written, indent=2, default=str))
        click.echo(f"wrote {json_out}")


def _sampling_params(
    config: EngineConfig,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    n: int,
    beam_width: int | None,
    length_penalty: float,
) -> SamplingParams:
    if beam_width is not None and beam_width < n:
        raise ConfigError(
            f"--beam-width {beam_width} is less than --n {n}: beam search returns the best --n of "
            f"--beam-width beams, so use --beam-width {n} or more"
        )
    if beam_width is None and length_penalty != 1.0:
        raise ConfigError(
            "--length-penalty scores beams and does nothing without --beam-width: add --beam-width N, or drop it"
        )
    return SamplingParams(
        max_tokens=64 if max_tokens is None else max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=config.seed,
        n=n,
        use_beam_search=beam_width is not None,
        best_of=beam_width,
        length_penalty=length_penalty,
    )


def _early_workload(
    prompts: list[str], dataset: str, workload_args: dict[str, Any], params: SamplingParams
) -> Workload | None:
    """The --prompt texts, or a file or named text workload, read before any weights; None for the
    workloads drawn from the model's vocabulary."""
    if prompts:
        for i, text in enumerate(prompts):
            try:
                check_text(text)
            except RequestError as exc:
                raise RequestError(f"--prompt {i + 1}: {exc}") from None
        return Workload("prompts", list(prompts), [params.max_tokens] * len(prompts), chat=True)
    if not needs_vocab(dataset):  # files are read and parsed now, not after the weights load
        return load_workload(vocab_size=0, **workload_args)
    return None


def _print_generations(workload: Workload, outputs: list[RequestOutput], show: int) -> None:
    for prompt, out in list(zip(workload.prompts, outputs))[:show]:
        shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        click.echo(f"\n> {shown}")
        for completion in out.outputs:
            text = completion.text if completion.text else f"<{len(completion.token_ids)} token ids>"
            click.echo(f"  {text.strip()}  [{completion.finish_reason}]")
    click.echo("")


def _print_run(config: EngineConfig, record: RunRecord) -> None:
    """The engine's description, the decoder's lossiness and speculative figures, above the table."""
    click.echo(
        f"model={config.model} "
        + " ".join(
            f"{k}={v}" for k, v in record.config.items() if k not in ("model", "config_hash", "weight_bytes", "lossy")
        )
    )
    if "lossy" in record.config:  # a decoder that changes outputs says how
        click.echo(f"lossy: {record.config['lossy']}")
    if "acceptance_rate" in record.decoding:
        d = record.decoding
        click.echo(
            f"speculative: acceptance {d['acceptance_rate']:.1%}, {d['mean_accepted_tokens']:.2f} draft tokens accepted "
            f"and {d['mean_tokens_per_step']:.2f} tokens per request-step, draft/verify time {d['draft_verify_time_ratio']:.2f}"
        )


def _report_profile(summary: dict[str, Any], record: RunRecord, chart: Path | None) -> None:
    click.echo("")
    click.echo(format_profile(summary))
    if chart is not None:
        from infer.bench.charts import profile_chart

        title = f"infer run --profile: {record.config.get('model')} on {record.config.get('device')} ({record.config.get('dtype')})"
        click.echo(profile_chart(summary, chart, title) or f"wrote {chart}")


def phases_text(engine: Any) -> str:
    """ "load 12.1 s, kv_cache 3.0 s, ...": the build's phases (`EngineParts.build_phases`)."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in (engine.parts.build_phases or {}).items())
