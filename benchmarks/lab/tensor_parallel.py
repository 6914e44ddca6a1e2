"""What does tensor parallelism buy on two GPUs of one host? Engine-spawned ranks over NCCL, dummy
weights, each engine warmed up (Triton compiles, allocator) and then timed.

    python -m benchmarks.lab.tensor_parallel [70b] [7b] [spec] [--out tp.json] [--requests 200]

70b:  llama2-70b (138 GB of bf16 weights: 69 GB per H200 at tp 2, the rest is KV cache) on the
      sharegpt-like workload, --requests requests.
7b:   llama2-7b on latency-1 (one request: 128 prompt tokens, 256 new) at tp 1 and tp 2 (auto, then
      each of --all-reduce): tokens/s, each tp2/tp1 per-token speedup (time per output token, p50),
      each forward's device time and rank 0's kernels.
spec: llama2-70b at tp 2 verifying llama2-7b drafts (K=4), beside llama2-70b tp 2 autoregressive,
      on latency-1: step times, verify time, acceptance (0 on random weights).

auto's symmetric-memory all-reduce serves the first tensor-parallel engine of a process only (torch
numbers a process's rendezvous; later engines keep NCCL and say so): with "70b 7b", 70b has it and
7b's auto does not. Llama-2's checkpoints say float16, which the symmetric-memory all-reduce cannot
sum: --dtype bfloat16 (the default) keeps it in play. Prints a table; writes --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from typing import Any

import torch

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.ceilings import decode_step_seconds
from infer.bench.engines import release_memory
from infer.bench.report import format_table, run_workload, warm_up
from infer.bench.workloads import load_workload
from infer.common.log import configure
from infer.core.engine import Engine
from infer.distributed.launch import launch
from infer.runtime.builder import make_engine

PARTS = ("70b", "7b", "spec")


def run(label: str, workload: str, num_prompts: int, args: argparse.Namespace, **options: Any) -> dict:
    return run_many([(label, workload, num_prompts)], args, **options)[0]


def print_kernels(label: str, engine: Engine) -> None:
    """The GPUs' time for a batch-1 step, then where it goes on rank 0."""
    step_s, kernels = decode_step_seconds(engine, profile=True)
    total = sum(k["critical_us_per_step"] for k in kernels)
    print(
        f"{label}: decode forward alone {step_s * 1e3:.3f} ms (back to back, graphs); rank 0 kernels "
        f"{total / 1e3:.3f} ms per step (critical: what each adds to the step; own: its span):",
        flush=True,
    )
    for k in sorted(kernels, key=lambda k: -k["critical_us_per_step"])[:16]:
        print(
            f"    {k['critical_us_per_step']:8.1f} us critical  {k['us_per_step']:8.1f} us own  "
            f"x{k['count_per_step']:4.0f}  {k['kernel']}",
            flush=True,
        )


def run_many(jobs: list, args: argparse.Namespace, **options: Any) -> list:
    """One engine, warmed up, then each (label, workload, num_prompts) job timed in turn."""
    # an engine that takes longer than this (a hang in start-up or teardown) prints every thread's stack
    faulthandler.dump_traceback_later(args.stacks_after_s, repeat=True)
    started = time.perf_counter()
    engine = make_engine(EngineConfig(load_format="dummy", dtype=args.dtype, **options), launch=launch)
    build_s = time.perf_counter() - started
    results = []
    try:
        vocab = engine.parts.vocab_size
        for label, workload, num_prompts in jobs:
            warm = load_workload(workload, vocab, 4, 8, seed=1)
            warm_up(engine, warm)  # count the measured run only
            record, _ = run_workload(
                engine, load_workload(workload, vocab, num_prompts, None, seed=0), SamplingParams(temperature=0), label
            )
            stats = engine.stats()
            if workload == "latency-1":
                print_kernels(label, engine)
            print(
                f"{label}: built in {build_s:.0f} s, {record.output_tokens_per_s:.1f} output tok/s, "
                f"TPOT p50 {record.tpot_p50_s * 1e3:.2f} ms, KV blocks {engine.parts.describe['kv_blocks']}, "
                f"all-reduce {engine.parts.describe.get('all_reduce', '-')}, pipelined steps "
                f"{stats.get('pipelined_steps', 0)} (misses {stats.get('pipeline_misses', 0)})",
                flush=True,
            )
            results.append({**record.to_dict(), "build_s": build_s, "record": record, "engine_stats": engine.stats()})
        return results
    finally:
        engine.close()
        del engine
        release_memory()


def measure_7b(args: argparse.Namespace, results: dict[str, dict]) -> None:
    for tp in (1, 2):
        label = f"llama2-7b tp{tp} latency-1"
        results[label] = run(label, "latency-1", 1, args, model="llama2-7b", tensor_parallel_size=tp)
    for choice in args.all_reduce:
        try:
            results[f"llama2-7b tp2 latency-1 {choice}"] = run(
                f"llama2-7b tp2 latency-1, --all-reduce {choice}",
                "latency-1",
                1,
                args,
                model="llama2-7b",
                tensor_parallel_size=2,
                all_reduce=choice,
            )
        except Exception as exc:  # a strategy that cannot run here is reported, the rest goes on
            print(f"llama2-7b tp2 --all-reduce {choice}: {type(exc).__name__}: {exc}", flush=True)


def measure_spec(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """The 70b engine once: latency-1, then sharegpt-like when "70b" is asked too; then speculative."""
    jobs = [("llama2-70b tp2 latency-1", "latency-1", 1)]
    if "70b" in args.parts:
        jobs.append(("llama2-70b tp2 sharegpt-like", "sharegpt-like", args.requests))
    done = run_many(jobs, args, model="llama2-70b", tensor_parallel_size=2)
    base = done[0]
    if "70b" in args.parts:
        results["llama2-70b tp2 sharegpt-like"] = done[1]
    spec = run(
        "llama2-70b tp2 speculative, draft llama2-7b, K=4, latency-1",
        "latency-1",
        1,
        args,
        model="llama2-70b",
        tensor_parallel_size=2,
        decoding="speculative",
        draft="llama2-7b",
        num_speculative_tokens=4,
    )
    results["llama2-70b tp2 latency-1"], results["llama2-70b tp2 speculative llama2-7b"] = base, spec
    stats, steps = spec["engine_stats"], max(spec["steps"], 1)
    print(
        f"70b/7b speculative at tp 2: target step {base['tpot_p50_s'] * 1e3:.2f} ms, per spec step: draft K=4 "
        f"{stats.get('spec_draft_s', 0) / steps * 1e3:.2f} ms, verify {stats.get('spec_verify_s', 0) / steps * 1e3:.2f} ms; "
        f"acceptance {stats.get('acceptance_rate')}; {spec['output_tokens_per_s']:.1f} vs "
        f"{base['output_tokens_per_s']:.1f} output tok/s",
        flush=True,
    )


def print_summary(results: dict[str, dict], with_7b: bool) -> None:
    """The report's table, a line per run, and each tp2/tp1 per-token speedup (added to `results`)."""
    print()
    print(format_table([r.pop("record") for r in results.values()]))
    print()
    for label, r in results.items():
        print(
            f"{label:32s} {r['output_tokens_per_s']:9.1f} output tok/s  {r['total_tokens_per_s']:9.1f} total tok/s  "
            f"TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms"
        )
    if with_7b:
        tp1 = results["llama2-7b tp1 latency-1"]
        for label in [k for k in results if k.startswith("llama2-7b tp2 latency-1")]:
            tp2 = results[label]
            speedup = tp1["tpot_p50_s"] / tp2["tpot_p50_s"]
            print(
                f"{label}: per-token speedup over tp1 {speedup:.2f}x "
                f"({tp1['tpot_p50_s'] * 1e3:.2f} ms -> {tp2['tpot_p50_s'] * 1e3:.2f} ms per token)"
            )
            results[f"speedup {label}"] = {"value": speedup}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.tensor_parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("parts", nargs="*", default=["70b", "7b"], help=f"any of {' '.join(PARTS)} (default: 70b 7b)")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--requests", type=int, default=200, help="sharegpt-like requests of the 70b part")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--all-reduce", nargs="*", default=["nccl", "flashinfer"], help="7b: the tp2 --all-reduce choices after auto"
    )
    ap.add_argument(
        "--stacks-after-s", type=int, default=240, help="print every thread's stack after an engine takes this long"
    )
    args = ap.parse_args(argv)
    if unknown := [p for p in args.parts if p not in PARTS]:
        ap.error(f"unknown part {' '.join(unknown)}: use {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure(level="warning")
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    results: dict[str, dict] = {}
    if "70b" in args.parts and "spec" not in args.parts:
        label = "llama2-70b tp2 sharegpt-like"
        results[label] = run(label, "sharegpt-like", args.requests, args, model="llama2-70b", tensor_parallel_size=2)
    if "7b" in args.parts:
        measure_7b(args, results)
    if "spec" in args.parts:
        measure_spec(args, results)
    print_summary(results, "7b" in args.parts)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":  # spawned ranks import this module again: they must not run this
    main()
