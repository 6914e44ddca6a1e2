"""`infer bench accuracy`: what a lossy configuration (FP8 weights, an FP8 KV cache, ...) costs, measured
against the same engine without it, on real text (`infer.bench.texts`):

- perplexity: exp of the mean negative log-likelihood of every window token after the first, given the
  tokens before it in its window, from the prefill's own logits (`SamplingParams.prompt_logprobs`);
  reported with its ratio to the baseline's;
- greedy agreement with the baseline's greedy outputs (`infer.testing.agreement`): the share of each
  output before its first difference (prefix), and the share of next tokens picked as the baseline
  did given its prefixes (forced). The baseline's own forced figure is measured too: the prefill that
  scores prefixes and the decode steps that made the outputs batch their products differently, so
  in bfloat16 a near-tie can fall either way even without a lossy change.

Each configuration is one engine, built and closed in turn in this process.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, InferError, RequestError
from infer.api.request import SamplingParams
from infer.api.slots import find
from infer.bench.engines import release_memory
from infer.bench.texts import TextSet, load_text_set
from infer.distributed.launch import launch
from infer.runtime.builder import make_engine
from infer.testing.agreement import forced_agreement, prefix_agreement

DEFAULT_COMPARE = ("quantization=fp8", "kv_cache_dtype=fp8", "quantization=fp8,kv_cache_dtype=fp8")


@dataclass(slots=True)
class AccuracyRow:
    label: str  # "baseline", or the --compare text ("quantization=fp8,kv_cache_dtype=fp8")
    changes: dict[str, Any]  # EngineConfig fields changed from the baseline's
    perplexity: float  # exp(mean NLL) over the windows' scored tokens
    scored_tokens: int  # tokens whose logprob entered the perplexity
    prefix_agreement: float  # mean share of each greedy output before its first difference from the baseline's
    forced_agreement: float  # share of next tokens equal to the baseline's, given the baseline's prefixes
    wall_s: float  # measuring, engine build aside
    describe: dict[str, Any] = field(default_factory=dict)  # the engine's plugin set, dtype, KV blocks, ...
    ratio: float = 1.0  # perplexity / the baseline's


def parse_compare(spec: str) -> dict[str, Any]:
    """ "quantization=fp8,kv_cache_dtype=fp8" -> typed EngineConfig changes (a slot's name names its field)."""
    changes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise ConfigError(
                f"--compare {spec!r}: write FIELD=VALUE pairs joined by commas, e.g. quantization=fp8,kv_cache_dtype=fp8"
            )
        slot = find(key)
        name = slot.field if slot is not None and slot.field else key.strip().replace("-", "_")
        changes[name] = EngineConfig.parse_option(name, value, f"--compare {item!r}")
    if not changes:
        raise ConfigError("--compare is empty: write FIELD=VALUE pairs, e.g. --compare kv_cache_dtype=fp8")
    return changes


def perplexity(engine: Any, windows: list[list[int]]) -> tuple[float, int]:
    """(exp(mean NLL), tokens scored) of every window token after the first, given those before it."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for i, (window, out) in enumerate(zip(windows, engine.generate(windows, params), strict=True)):
        if out.error is not None:
            raise RequestError(f"perplexity window {i}: {out.error}")
        nll -= sum(scores[t] for scores, t in zip(out.prompt_logprobs[1:], window[1:], strict=True))
        count += len(window) - 1
    return math.exp(nll / count), count


def greedy(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs):
        if out.error is not None:
            raise RequestError(f"greedy prompt {i}: {out.error}")
    return [o.outputs[0].token_ids for o in outputs]


def _check_fits(engine: Any, window_tokens: int, prompt_tokens: int, max_tokens: int) -> None:
    limit, model = engine.parts.max_model_len, engine.parts.describe["model"]
    if window_tokens >= limit:
        raise ConfigError(
            f"--window-tokens {window_tokens} does not fit {model}'s context of {limit} tokens (one new token "
            f"included): use at most {limit - 1}, or raise --max-model-len"
        )
    if prompt_tokens + max_tokens > limit:
        raise ConfigError(
            f"--prompt-tokens {prompt_tokens} + --max-tokens {max_tokens} exceed {model}'s context of {limit} "
            f"tokens: ask for fewer, or raise --max-model-len"
        )


@dataclass(slots=True)
class Measured:
    rows: list[AccuracyRow]  # the baseline first, then each configuration that ran
    skipped: list[dict[str, str]]  # {"label", "reason"} of the configurations that could not run here
    text: TextSet  # what was scored and prompted


def measure(
    base: EngineConfig,
    variants: list[tuple[str, dict[str, Any]]],
    sizes: dict[str, int],  # windows, window_tokens, prompts, prompt_tokens, max_tokens
    extra_plugins: list[Any],
) -> Measured:

    text: TextSet | None = None
    reference: list[list[int]] = []
    rows: list[AccuracyRow] = []
    skipped: list[dict[str, str]] = []
    for i, (label, changes) in enumerate(variants):
        click.echo(f"running {label} ({i + 1}/{len(variants)})", err=True)
        try:
            engine = make_engine(replace(base, **changes), extra_plugins, launch)
        except InferError as exc:
            if not rows:  # the baseline is what every figure is relative to
                raise
            skipped.append({"label": label, "reason": str(exc)})
            click.echo(f"skipped {label}: {exc}")
            continue
        try:
            if text is None:
                _check_fits(engine, sizes["window_tokens"], sizes["prompt_tokens"], sizes["max_tokens"])
                vocab = engine.parts.vocab_size
                text = load_text_set(
                    engine.tokenizer,
                    vocab,
                    sizes["windows"],
                    sizes["window_tokens"],
                    sizes["prompts"],
                    sizes["prompt_tokens"],
                )
            started = time.perf_counter()
            ppl, scored = perplexity(engine, text.windows)
            outputs = greedy(engine, text.prompts, sizes["max_tokens"])
            reference = reference or outputs
            prefix = prefix_agreement(reference, outputs)
            forced = forced_agreement(engine, text.prompts, reference)
            wall = time.perf_counter() - started
            rows.append(AccuracyRow(label, changes, ppl, scored, prefix, forced, wall, dict(engine.parts.describe)))
        finally:
            engine.close()
            del engine
            release_memory()
    assert text is not None
    for row in rows:
        row.ratio = row.perplexity / rows[0].perplexity
    return Measured(rows, skipped, text)


def format_table(rows: list[AccuracyRow]) -> str:
    headers = ["config", "perplexity", "ratio", "prefix agreement", "forced agreement", "time s"]
    table = [
        [
            r.label,
            f"{r.perplexity:.4f}",
            f"{r.ratio:.4f}",
            f"{r.prefix_agreement:.1%}",
            f"{r.forced_agreement:.1%}",
            f"{r.wall_s:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(row) for row in table)])


def run_accuracy(
    base: EngineConfig,
    compares: list[str],
    sizes: dict[str, int],  # windows, window_tokens, prompts, prompt_tokens, max_tokens
    json_out: Path | None,
    extra_plugins: list[Any],
) -> Measured:
    base.validate()
    variants: list[tuple[str, dict[str, Any]]] = [("baseline", {})]
    for spec in compares or DEFAULT_COMPARE:
        changes = parse_compare(spec)
        replace(base, **changes).validate()  # a value out of range is the user's error, before any weights load
        variants.append((spec, changes))
    run = measure(base, variants, sizes, extra_plugins)
    described = run.rows[0].describe
    title = (
        f"infer bench accuracy: {described['model']} on {described['device']} ({described['dtype']}); "
        f"perplexity over {run.rows[0].scored_tokens} tokens ({run.text.name}); "
        f"greedy agreement over {sizes['prompts']} prompts x {sizes['max_tokens']} tokens, against the baseline"
    )
    click.echo(title)
    click.echo(format_table(run.rows))
    if json_out is not None:
        record = {"title": title, "text": run.text.name, **sizes, "rows": [asdict(r) for r in run.rows]}
        json_out.write_text(json.dumps({**record, "skipped": run.skipped}, indent=2, default=str))
        click.echo(f"wrote {json_out}")
    return run
