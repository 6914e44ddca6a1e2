"""`infer run`: build the engine(s), run the workload, print the table, write JSON."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import click

from infer.bench.report import RunRecord, format_table, run_workload
from infer.bench.workloads import Workload, load_workload
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import RequestOutput, SamplingParams


def _label(config: EngineConfig, base: EngineConfig | None) -> str:
    if base is None:
        return "infer"
    diff = {k: v for k, v in config.to_dict().items() if base.to_dict()[k] != v}
    return ",".join(f"{k}={v}" for k, v in diff.items()) or "infer"


def _run_one(config: EngineConfig, workload_args: dict[str, Any], prompts: list[str], params: SamplingParams,
             label: str, progress: bool) -> tuple[RunRecord, list[RequestOutput], Workload]:
    engine = Engine.from_config(config)
    try:
        if prompts:
            workload = Workload("prompts", list(prompts), [params.max_tokens] * len(prompts), chat=True)
        else:
            workload = load_workload(vocab_size=engine.parts.vocab_size, **workload_args)
        bar_cm = click.progressbar(length=len(workload.prompts), label=label, file=click.get_text_stream("stderr")) if progress else contextlib.nullcontext()
        with bar_cm as bar:
            record, outputs = run_workload(engine, workload, params, label, on_finish=(lambda _o: bar.update(1)) if progress else None)
        return record, outputs, workload
    finally:
        engine.close()


def run_command(config: EngineConfig, dataset: str, prompts: list[str], num_prompts: int | None, max_tokens: int | None,
                temperature: float, top_p: float, top_k: int, baseline: dict[str, Any] | None, json_out: Path | None,
                show: int, progress: bool) -> None:
    config.validate()
    params = SamplingParams(max_tokens=64 if max_tokens is None else max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=config.seed)
    workload_args = dict(name=dataset, num_prompts=num_prompts, max_tokens=max_tokens, seed=config.seed)
    records: list[RunRecord] = []
    if baseline is not None:
        base_config = config.replace(**baseline)
        base_record, _, _ = _run_one(base_config, workload_args, prompts, params, "baseline: " + _label(base_config, config), progress)
        records.append(base_record)
    record, outputs, workload = _run_one(config, workload_args, prompts, params, "infer", progress)
    if baseline is not None:
        record.speedup = record.total_tokens_per_s / records[0].total_tokens_per_s
    records.append(record)

    for prompt, out in list(zip(workload.prompts, outputs))[:show]:
        shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        click.echo(f"\n> {shown}")
        for completion in out.outputs:
            text = completion.text if completion.text else f"<{len(completion.token_ids)} token ids>"
            click.echo(f"  {text.strip()}  [{completion.finish_reason}]")
    click.echo("")
    click.echo(f"model={config.model} " + " ".join(f"{k}={v}" for k, v in record.config.items() if k not in ("model", "config_hash", "weight_bytes")))
    click.echo(format_table(records))
    if json_out is not None:
        json_out.write_text(json.dumps({"records": [r.to_dict() for r in records]}, indent=2, default=str))
        click.echo(f"wrote {json_out}")


