"""`infer bench --matrix`: every valid combination of the named strategies over one workload in one
process, beside HF transformers baselines; a table with speedups, JSON and a PNG chart."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import click

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, InferError
from infer.api.request import SamplingParams
from infer.api.slots import CHOSEN, PREFILL_ATTENTION, find
from infer.bench.engines import release_memory
from infer.bench.report import RunRecord, prepare_prompts, run_workload, warm_up_shaped
from infer.bench.workloads import Workload, load_workload, needs_vocab
from infer.core.registry import PluginRegistry
from infer.distributed.launch import launch
from infer.runtime.builder import make_engine
from infer.tools.doctor import diagnose

PEERS = ("hf-static-1", "hf-static-64", "hf-continuous")


@dataclass(slots=True)
class Combination:
    label: str  # "attention=torch,sampler=naive"
    config: EngineConfig
    reason: str | None  # None: runs here


def parse_axes(axes: Iterable[str]) -> dict[str, list[Any]]:
    """["attention=torch,paged-cuda", "block_size=16,32"] -> {"attention": [...], "block_size": [16, 32]},
    each value converted by its EngineConfig field's declared type; a slot's name or alias names its field."""
    parsed: dict[str, list[Any]] = {}
    for axis in axes:
        key, sep, values = axis.partition("=")
        slot = find(key)
        key = slot.field if slot is not None and slot.field else key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ConfigError(
                f"--matrix {axis!r}: write FIELD=A,B with FIELD an engine option "
                f"(attention, sampler, scheduler, decoding, kv_allocator, block_size, ...)"
            )
        parsed[key] = [EngineConfig.parse_option(key, v, f"--matrix {axis!r}") for v in values.split(",") if v.strip()]
    if not parsed:
        raise ConfigError(
            "--matrix needs at least one axis, e.g. --matrix attention=torch,paged-cuda sampler=naive,vectorized"
        )
    return parsed


def _check_names(axes: dict[str, list[Any]], registry: PluginRegistry) -> None:
    """A misspelled strategy name is the user's error (exit 2), not a combination that cannot run here."""
    for slot in (*CHOSEN, PREFILL_ATTENTION):
        for name in axes.get(slot.field, ()):
            if name is not None and not (slot.field == "attention" and name == "auto"):
                registry.get(slot.name, name)


def combinations(base: EngineConfig, axes: dict[str, list[Any]], registry: PluginRegistry) -> list[Combination]:
    _check_names(axes, registry)
    found = []
    for values in itertools.product(*axes.values()):
        changes = dict(zip(axes, values))
        config = replace(base, **changes)
        config.validate()  # a value out of range is the user's error, whatever the combination
        if "decoding" in axes:  # --draft / --exit-layer belong to the decoders that read them
            caps = registry.get("decoding", config.decoding).capabilities
            if not caps.needs_draft:
                config = replace(config, draft=None, exit_layer=None if not caps.uses_exit_layer else config.exit_layer)
        refusals = diagnose(config, registry, check_model=False).refusals
        label = ",".join(f"{k}={v}" for k, v in changes.items())
        found.append(Combination(label, config, refusals[0].reason if refusals else None))
    return found


def _peer_runs(
    names: list[str], config: EngineConfig, described: dict[str, Any], workload: Workload, prompts: list[list[int]]
) -> list[dict[str, Any]]:
    import torch

    from infer.api.config import DTYPES
    from infer.bench.peers import build_hf_model, hf_continuous, hf_static
    from infer.loading.loader import resolve_source

    source = resolve_source(
        config.model, PluginRegistry.load(), config.load_format, pull=False, revision=config.revision
    )
    device, dtype = torch.device(described["device"]), DTYPES[described["dtype"]]
    folder = str(source.path) if source.path else None
    model = build_hf_model(source.hf_config, dtype, device, folder=folder, seed=config.seed)
    runs = []
    for name in names:
        click.echo(f"running baseline {name}", err=True)
        if name == "hf-continuous":
            record = hf_continuous(model, prompts, max(workload.max_tokens))
        else:
            record = hf_static(model, prompts, workload.max_tokens, int(name.rsplit("-", 1)[1]))
        row = record.to_dict()
        row.update(
            kind="baseline",
            label=name,
            total_tokens_per_s=(
                (record.prompt_tokens + record.output_tokens) / record.wall_s if record.wall_s else 0.0
            ),
        )
        runs.append(row)
    return runs


def _infer_row(record: RunRecord) -> dict[str, Any]:
    return {**record.to_dict(), "kind": "infer"}


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["run", "kind", "req/s", "out tok/s", "total tok/s", "time s", "TTFT p50 ms", "TPOT p50 ms", "speedup"]
    table = []
    for r in rows:
        infer_only = r["kind"] == "infer"
        table.append(
            [
                r["label"],
                r["kind"],
                f"{r['num_requests'] / r['wall_s']:.2f}" if r["wall_s"] else "—",
                f"{r['output_tokens_per_s']:.1f}",
                f"{r['total_tokens_per_s']:.1f}",
                f"{r['wall_s']:.2f}",
                f"{r['ttft_p50_s'] * 1e3:.1f}" if infer_only else "—",
                f"{r['tpot_p50_s'] * 1e3:.1f}" if infer_only else "—",
                "—" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(row) for row in table)])


@dataclass(slots=True)
class MatrixRun:
    rows: list[dict[str, Any]]  # one per run: RunRecord / PeerRecord fields, kind, speedup
    workload: Workload
    prompts: list[list[int]]  # the workload's token ids, as every run saw them
    described: dict[str, Any]  # model, device, dtype of the first engine


def _run_combinations(
    runnable: list[Combination],
    dataset: str,
    num_prompts: int | None,
    max_tokens: int | None,
    seed: int,
    repeat: int,
    extra_plugins: list[Any],
) -> MatrixRun | None:

    params = SamplingParams(
        max_tokens=64 if max_tokens is None else max_tokens, temperature=0.0, ignore_eos=True, seed=seed
    )
    # a file or named text workload is read before the first engine: its errors come before any weights
    early = None if needs_vocab(dataset) else load_workload(dataset, 0, num_prompts, max_tokens, seed)
    run: MatrixRun | None = None
    for i, combo in enumerate(runnable):
        click.echo(f"running {combo.label} ({i + 1}/{len(runnable)})", err=True)
        try:
            engine = make_engine(combo.config, extra_plugins, launch)
        except InferError as exc:  # refused by a factory itself (an option the capabilities do not describe)
            combo.reason = str(exc)
            click.echo(f"skipped {combo.label}: {combo.reason}")
            continue
        try:
            if run is None:
                workload = early or load_workload(dataset, engine.parts.vocab_size, num_prompts, max_tokens, seed)
                prompts = prepare_prompts(engine, workload)
                run = MatrixRun([], workload, prompts, dict(engine.parts.describe))
            warm_up_shaped(engine, run.workload, params)  # its shapes, not its prompts: the prefix cache stays honest
            records = [run_workload(engine, run.workload, params, combo.label)[0] for _ in range(repeat)]
            run.rows.append(_infer_row(max(records, key=lambda r: r.total_tokens_per_s)))
        finally:
            engine.close()
            del engine
            release_memory()
    return run


def run_matrix(
    base: EngineConfig,
    axes: list[str],
    baselines: list[str],
    dataset: str,
    num_prompts: int | None,
    max_tokens: int | None,
    json_out: Path | None,
    chart: Path | None,
    extra_plugins: list[Any],
    repeat: int = 1,
) -> None:
    if repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {repeat}")
    unknown = [b for b in baselines if b not in PEERS]
    if unknown:
        raise ConfigError(f"unknown --baseline {', '.join(unknown)}: use {', '.join(PEERS)}")
    base.validate()
    combos = combinations(base, parse_axes(axes), PluginRegistry.load(extra_plugins))
    for c in combos:
        if c.reason is not None:
            click.echo(f"skipped {c.label}: {c.reason}")
    runnable = [c for c in combos if c.reason is None]
    run = (
        _run_combinations(runnable, dataset, num_prompts, max_tokens, base.seed, repeat, extra_plugins)
        if runnable
        else None
    )
    if run is None:
        raise ConfigError("no combination of --matrix runs here: see the reasons above (`infer doctor` explains one)")
    rows, described, workload = run.rows, run.described, run.workload
    if baselines:
        rows += _peer_runs(baselines, runnable[0].config, described, workload, run.prompts)
    reference = baselines[0] if baselines else rows[0]["label"]
    ref_rate = next(r["total_tokens_per_s"] for r in rows if r["label"] == reference)
    for r in rows:
        r["speedup"] = r["total_tokens_per_s"] / ref_rate if ref_rate and not r.get("error") else None
    title = (
        f"infer bench: {described['model']} on {described['device']} ({described['dtype']}), "
        f"workload {workload.name} x{len(workload.prompts)}, {max(workload.max_tokens)} new tokens, EOS ignored"
        + (f", best of {repeat}" if repeat > 1 else "")
    )
    click.echo(title)
    click.echo(format_rows(rows))
    click.echo(f"speedup: total tokens/s against {reference}")
    for r in rows:
        if r.get("error"):
            click.echo(f"baseline {r['label']} failed: {r['error']}")
    if json_out is not None:
        skipped = [{"label": c.label, "reason": c.reason} for c in combos if c.reason is not None]
        json_out.write_text(
            json.dumps(
                {"title": title, "describe": described, "speedup_against": reference, "runs": rows, "skipped": skipped},
                indent=2,
                default=str,
            )
        )
        click.echo(f"wrote {json_out}")
    if chart is not None:
        from infer.bench.charts import bench_chart

        click.echo(bench_chart(rows, chart, title, reference) or f"wrote {chart}")
