"""What structured output costs: time per output token with a JSON-schema constraint on every request
against the same workload unconstrained, in one engine, runs alternated.

    python -m benchmarks.lab.structured --model llama3-8b --load-format dummy --tokenizer smollm2-135m \
        --batch 64 --out structured.json

The schema asks for an array of at least 64 records (an integer, a bounded string, a list of tags, a
boolean), so no output can end it within --max-tokens: every step of every request is masked. Both
runs ignore EOS and decode --max-tokens tokens from random prompts of --prompt-tokens ids (drawn
below the tokenizer's size). With --tokenizer smaller than the model's vocabulary, both runs mask
the ids past it (the `tokenizer-vocab` processor), so the difference is the grammar's alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import Workload
from infer.core.engine import Engine
from infer.plugins.logits_processor.grammar import XGrammarProcessor
from infer.runtime.builder import make_engine

SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "active"],
    },
}


def free_strings(schema: Any) -> Any:
    """`schema` without maxLength: strings of any length."""
    if isinstance(schema, dict):
        return {k: free_strings(v) for k, v in schema.items() if k != "maxLength"}
    return schema


SCHEMAS = {"records": SCHEMA, "records-free": free_strings(SCHEMA)}


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[str | list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


GRAMMAR_TIMES = ("seconds_ahead", "seconds_filling", "seconds_waited", "seconds_applying", "rows_ahead", "rows_in_step")


def grammar_times(engine: Engine) -> dict[str, float]:
    """The xgrammar processor's counters (where the mask work went), summed so far."""
    found = [p for p in engine.parts.processors if isinstance(p, XGrammarProcessor)]
    return {k: float(getattr(found[0], k)) for k in GRAMMAR_TIMES} if found else {}


def measure(engine: Engine, workload: Workload, params: SamplingParams, label: str) -> dict[str, Any]:
    engine.reset_stats()
    before = grammar_times(engine)
    record, outputs = run_workload(engine, workload, params, label)
    out = record.to_dict()
    out["label"] = label
    after = grammar_times(engine)
    steps = max(1, out["steps"])
    out["grammar_per_step"] = {k: (after[k] - before[k]) / steps for k in after}
    if params.structured is not None:  # what was generated is valid so far: a prefix of the schema's language
        out["sample"] = outputs[0].outputs[0].text[:200]
    print(
        f"{label:12s} out tok/s {out['output_tokens_per_s']:9.1f}  TPOT p50 {out['tpot_p50_s'] * 1e3:7.2f} ms  "
        f"p99 {out['tpot_p99_s'] * 1e3:7.2f} ms  steps {out['steps']}",
        flush=True,
    )
    if params.structured is not None and after:
        g = out["grammar_per_step"]
        print(
            f"{'':12s} per step: ahead job {g['seconds_ahead'] * 1e3:.2f} ms (fill {g['seconds_filling'] * 1e3:.2f}), "
            f"in the step {g['seconds_applying'] * 1e3:.2f} ms (waiting {g['seconds_waited'] * 1e3:.2f}); "
            f"rows ahead {g['rows_ahead']:.1f}, in step {g['rows_in_step']:.2f}",
            flush=True,
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.batch,
    )
    engine = make_engine(config)
    try:
        assert engine.tokenizer is not None, "structured output needs a tokenizer: pass --tokenizer"
        vocab = min(len(engine.tokenizer), engine.parts.vocab_size)
        prompts = random_prompts(args.prompts, args.prompt_tokens, vocab, args.seed)
        workload = Workload("random", prompts, [args.max_tokens] * len(prompts), ignore_eos=True)
        plain = SamplingParams(temperature=0, ignore_eos=True)
        constrained = {name: replace(plain, structured={"json": SCHEMAS[name]}) for name in args.schema}
        short = Workload("warm", prompts[: args.batch], [16] * args.batch, ignore_eos=True)
        warm_up(engine, short)
        for params in constrained.values():  # compiles the schema and the mask kernel
            run_workload(engine, short, params, "warm-json")
        processor = next(p for p in engine.parts.processors if isinstance(p, XGrammarProcessor))
        runs: dict[str, list[dict[str, Any]]] = {"plain": []}
        for _ in range(args.repeat):
            runs["plain"].append(measure(engine, workload, plain, "plain"))
            for name, params in constrained.items():
                runs.setdefault(name, []).append(measure(engine, workload, params, name))
                if args.in_step:  # the same with every mask filled in its step (as before the masks went ahead)
                    processor.ahead = lambda rows: None  # type: ignore[method-assign]
                    try:
                        runs.setdefault(f"{name} in-step", []).append(
                            measure(engine, workload, params, f"{name} in-step")
                        )
                    finally:
                        del processor.ahead
    finally:
        engine.close()
    summary = {name: statistics.median(r["tpot_p50_s"] for r in rs) for name, rs in runs.items()}
    ratios = {name: tpot / summary["plain"] for name, tpot in summary.items() if name != "plain"}
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "device": engine.parts.describe.get("device"),
        "runs": runs,
        "tpot_p50_s": summary,
        "tpot_ratio": ratios,
    }
    for name, ratio in ratios.items():
        print(
            f"TPOT p50 {name} {summary[name] * 1e3:.2f} ms / plain {summary['plain'] * 1e3:.2f} ms = {ratio:.3f}x "
            f"(batch {args.batch})",
            flush=True,
        )
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64, help="requests at a time (max_num_seqs)")
    ap.add_argument("--prompts", type=int, default=128, help="requests per run")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2, help="rounds of plain and each schema, alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--schema",
        choices=sorted(SCHEMAS),
        nargs="+",
        default=["records"],
        help="one or more, each run after plain in turn; records-free: the same without maxLength",
    )
    ap.add_argument(
        "--in-step", action="store_true", help="also run each schema with every mask filled in its step, not ahead"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
