"""Speculative decoding on real weights: greedy agreement with a CPU fp32 run, and what `ngram` (on
prompts that ask to repeat or edit a text) and self-drafts at three exit layers buy against
autoregressive decoding measured in the same process, at batch 1 (one request at a time) and 8.

    python -m benchmarks.lab.speculative --device cpu --dtype float32 --save ref.json    # the reference, on a CPU
    python -m benchmarks.lab.speculative --reference ref.json --out speculative.json      # on the GPU (bf16)

`--repeats N` runs each engine over its workload N times after the warm-up, prefix caching off (each
pass prefills every prompt), and reports the median pass; every row gives the end-to-end speed-up
(output tokens/s, prefill included) and decoding's alone (TPOT p50, the time per token after the first).

The reference holds autoregressive greedy token ids for the agreement workload (the built-in
prompts, 64 tokens each: what `infer run` does) and for the edit workload. Every run is compared
with it (outputs identical, and the share of the tokens each output has before its first
different one) and with the autoregressive run of the same session.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.engines import release_memory
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import Workload, edit, load_workload
from infer.runtime.builder import make_engine


def run(args: argparse.Namespace, label: str, workload: Workload, batch: int, **opts: Any) -> dict[str, Any]:
    """One engine over `workload`, at most `batch` requests at a time, warmed up first; `args.repeats`
    passes, the median one reported (prefix caching off then, so every pass prefills every prompt)."""
    if args.repeats > 1:
        opts = {"enable_prefix_caching": False, **opts}
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=batch, **opts)
    engine = make_engine(config)
    try:
        n = min(batch, len(workload.prompts))
        warm_up(engine, Workload("warm", workload.prompts[:n], [8] * n, chat=workload.chat, ignore_eos=True))
        passes = [run_workload(engine, workload, SamplingParams(temperature=0), label) for _ in range(args.repeats)]
        rates = [p[0].output_tokens_per_s for p in passes]
        record, outputs = sorted(passes, key=lambda p: p[0].output_tokens_per_s)[len(passes) // 2]
        out = record.to_dict()
        out["passes_output_tokens_per_s"] = rates
        out["prompt_token_ids"] = [o.prompt_token_ids for o in outputs]
        out["token_ids"] = [o.outputs[0].token_ids for o in outputs]
        # runner -> {rows bucket: steps replayed}: verify steps replay the buckets past the batch
        out["graph_replays"] = {
            i: dict(r.graphs.replays) for i, r in enumerate(engine.parts.runners) if r.graphs is not None
        }
        stats = {k: round(v, 3) for k, v in engine.stats().items() if isinstance(v, float)}
        print(
            f"{label:44s} out tok/s {out['output_tokens_per_s']:8.1f}  TPOT p50 {out['tpot_p50_s'] * 1e3:7.2f} ms  "
            f"steps {out['steps']:5d}  {json.dumps(stats)}",
            flush=True,
        )
        return out
    finally:
        engine.close()
        del engine
        release_memory()


def agreement(ids: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """How closely `ids` follow `ref`: outputs identical, the share of ref's tokens matched before each
    output's first different token, and where that token is (None: none differs)."""
    prefixes = [
        next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(ids, ref)
    ]
    return {
        "identical": f"{sum(x == y for x, y in zip(ids, ref))}/{len(ref)}",
        "followed": sum(prefixes) / max(1, sum(len(y) for y in ref)),
        "first_difference": [p if p < len(y) or len(x) != len(y) else None for p, x, y in zip(prefixes, ids, ref)],
    }


def variants(exit_layers: list[int]) -> list[tuple[str, dict[str, Any]]]:
    return [("ngram", dict(draft="ngram"))] + [(f"self-{n}", dict(draft="self", exit_layer=n)) for n in exit_layers]


def session(
    args: argparse.Namespace, workload: Workload, batch: int, reference: dict[str, Any] | None
) -> dict[str, Any]:
    """Autoregressive, then each speculative variant, on `workload` at `batch`: speed-up against the
    autoregressive run, acceptance, tokens per step, and agreement with it and with the reference."""
    base = run(args, f"{workload.name} autoregressive, batch {batch}", workload, batch)
    ref = _reference_ids(reference, workload.name, base) if reference is not None else None
    rows: dict[str, Any] = {"autoregressive": _row(base, base, ref)}
    for name, opts in variants(args.exit_layers):
        label = f"{workload.name} speculative {name} K={args.k}, batch {batch}"
        r = run(args, label, workload, batch, decoding="speculative", num_speculative_tokens=args.k, **opts)
        rows[name] = _row(r, base, ref)
    return rows


def _row(r: dict[str, Any], base: dict[str, Any], ref: list[list[int]] | None) -> dict[str, Any]:
    stats = r["decoding"]
    row = {
        "output_tokens_per_s": r["output_tokens_per_s"],
        "speedup": r["output_tokens_per_s"] / base["output_tokens_per_s"],
        "tpot_p50_s": r["tpot_p50_s"],
        # decoding alone: the time per output token after the first (prefill and queueing left out)
        "tpot_speedup": base["tpot_p50_s"] / r["tpot_p50_s"] if r["tpot_p50_s"] else float("nan"),
        "passes_output_tokens_per_s": r.get("passes_output_tokens_per_s"),
        "steps": r["steps"],
        "acceptance_rate": stats.get("acceptance_rate"),
        "mean_tokens_per_step": stats.get("mean_tokens_per_step"),
        "graph_replays": r["graph_replays"],
        "vs_autoregressive": agreement(r["token_ids"], base["token_ids"]),
    }
    if ref is not None:
        row["vs_reference"] = agreement(r["token_ids"], ref)
    return row


def _reference_ids(reference: dict[str, Any], name: str, base: dict[str, Any]) -> list[list[int]]:
    saved = reference["workloads"].get(name)
    if saved is None or saved["prompt_token_ids"] != base["prompt_token_ids"]:
        raise SystemExit(
            f"the reference has no {name} run on these prompts: make it with the same --model, --prompts and "
            "--tokens (python -m benchmarks.lab.speculative --device cpu --dtype float32 --save FILE)"
        )
    return saved["token_ids"]


def save_reference(args: argparse.Namespace, workloads: list[Workload]) -> None:
    """Autoregressive greedy token ids of each workload (every prompt in one batch), for --reference."""
    saved = {}
    for w in workloads:
        r = run(args, f"{w.name} autoregressive (reference)", w, len(w.prompts))
        saved[w.name] = {"prompt_token_ids": r["prompt_token_ids"], "token_ids": r["token_ids"]}
    meta = {"model": args.model, "device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    Path(args.save).write_text(json.dumps({**meta, "workloads": saved}))
    print(f"reference token ids written to {args.save}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--save", default=None, help="write the autoregressive token ids here (the reference) and stop")
    ap.add_argument("--reference", default=None, help="compare every run with the token ids saved by --save")
    ap.add_argument("--out", default="speculative.json")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--exit-layers", default="8,16,24", help="self-draft exit layers, comma-separated")
    ap.add_argument("--batches", default="1,8", help="edit-workload batch sizes, comma-separated")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each workload")
    ap.add_argument("--tokens", type=int, default=160, help="output tokens per edit prompt")
    ap.add_argument("--agree-tokens", type=int, default=64, help="output tokens per built-in prompt")
    ap.add_argument(
        "--repeats", type=int, default=1, help="passes over the workload per engine (the median is reported)"
    )
    args = ap.parse_args(argv)
    args.exit_layers = [int(x) for x in args.exit_layers.split(",") if x]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    agree = load_workload("builtin", 0, args.prompts, args.agree_tokens, seed=0)
    edits = edit(args.prompts, args.tokens)
    if args.save:
        save_reference(args, [agree, edits])
        return
    reference = json.loads(Path(args.reference).read_text()) if args.reference else None
    device = EngineConfig(device=args.device).resolve_device()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "num_speculative_tokens": args.k,
        "reference": args.reference,
        # the built-in prompts in one batch, as `infer run` runs them
        "agreement": session(args, agree, len(agree.prompts), reference),
        "edit": {f"batch{b}": session(args, edits, b, reference) for b in args.batches},
    }
    result["seconds"] = time.time() - started
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))


def summary(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on {result['device']} ({result['dtype']}), K={result['num_speculative_tokens']}"]
    for part, rows in [("agreement", result["agreement"])] + [(f"edit {b}", r) for b, r in result["edit"].items()]:
        lines.append(f"{part}:")
        for name, row in rows.items():
            ref = row.get("vs_reference", {})
            accept = row["acceptance_rate"]
            lines.append(
                f"  {name:16s} speed-up {row['speedup']:5.2f}x (decoding {row['tpot_speedup']:5.2f}x)  acceptance "
                f"{'-' if accept is None else f'{accept:.1%}':>6s}  tokens/step "
                f"{row['mean_tokens_per_step'] or 1.0:4.2f}  same as autoregressive "
                f"{row['vs_autoregressive']['identical']:>5s}  same as reference {ref.get('identical', '-'):>5s} "
                f"(followed {ref.get('followed', float('nan')):.1%})"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
