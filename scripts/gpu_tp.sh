#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 GPUs (nvidia-h200-x2), engine-spawned ranks over NCCL:
#   bash scripts/gpu_tp.sh [allreduce] [pdl] [70b] [7b] [spec] [tests]   (default: 70b 7b; each part fits one 10-minute command)
# allreduce: NCCL against the symmetric-memory one-shot and FlashInfer's all-reduce per message size
#      (scripts/gpu_allreduce.py).
# pdl: llama2-7b latency-1 with programmatic dependent launch off and on, tp1 and tp2 (scripts/gpu_pdl.py,
#      PDL_ROUNDS rounds, default 1; PDL_VARY=NAME=V1,V2 varies another switch, e.g. INFER_PDL=0,1;
#      PDL_ALL_REDUCE: tp2's --all-reduce choices, default "symm-mem flashinfer").
# 70b: llama2-70b, dummy bf16 weights (138 GB: 69 GB per H200 at --tp 2, the rest is KV cache),
#      on the sharegpt-like workload, 200 requests (TP_REQUESTS to change).
# 7b:  llama2-7b on latency-1 (one request: 128 prompt tokens, 256 new) at --tp 1 and --tp 2 (auto, then
#      each --all-reduce in TP_CHOICES, default "nccl flashinfer"): tokens/s, each tp2/tp1 per-token speedup
#      (time per output token, p50), each forward's device time and rank 0's kernels.
# auto's symmetric-memory all-reduce serves the first tp engine of a process only (torch numbers a
# process's rendezvous; later engines keep NCCL and say so): with "70b 7b", 70b has it, 7b's auto does not.
# tests: the two-GPU tests (tests/gpu/test_all_reduce_gpu.py, test_tensor_parallel_gpu.py), last.
# spec: the seeds' composition, llama2-70b --tp 2 verifying llama2-7b drafts (K=4), beside llama2-70b
#      --tp 2 autoregressive, on latency-1: step times, verify time, acceptance (0 on random weights).
# All in bf16 (TP_DTYPE to change): Llama-2's checkpoints say float16, which the symmetric-memory
# all-reduce cannot sum (NCCL then does every all-reduce).
# Each engine is warmed up first (Triton compiles, allocator), then timed. Prints a table; writes $OUT/tp.json.
# Expects wheels in $WHEELS (default .whl/) like scripts/gpu_check.sh; the source tree comes first on the path.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -d "${WHEELS:-.whl}" ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.cache/flashinfer}  # its JIT builds, kept between parts
# FlashInfer's all-reduce build (2 minutes on a fresh machine) carried from an earlier run as a tarball
# (FI_CACHE, default .gpu/ficache.tgz, written to $OUT/ficache.tgz when absent): its sources are dated back
# so that ninja finds the carried objects up to date
fi_cache=${FI_CACHE:-.gpu/ficache.tgz}
if [ -f "$fi_cache" ] && [ ! -d "$FLASHINFER_WORKSPACE_BASE" ]; then
  tar xzf "$fi_cache" && find /tmp/site -exec touch -h -d 2020-01-01 {} + 2>/dev/null
fi
trap '[ -f "$fi_cache" ] || [ ! -d "$FLASHINFER_WORKSPACE_BASE" ] || tar czf "$OUT/ficache.tgz" -C "$PWD" "${FLASHINFER_WORKSPACE_BASE#$PWD/}"' EXIT
if [[ " $* " == *" allreduce "* ]]; then
  python3 scripts/gpu_allreduce.py 2>&1 | tee "$OUT/allreduce.log"
  ran_part=1  # with nothing else asked, do not fall through to the default engines
  set -- ${*//allreduce/}
fi
if [[ " $* " == *" pdl "* ]]; then
  python3 scripts/gpu_pdl.py --rounds "${PDL_ROUNDS:-1}" --vary "${PDL_VARY:-INFER_PDL=0,1}" \
    --all-reduce ${PDL_ALL_REDUCE:-symm-mem flashinfer} --out "$OUT/pdl.json" 2>&1 | tee "$OUT/pdl.log"
  ran_part=1
  set -- ${*//pdl/}
fi
if [[ " $* " == *" tests "* ]]; then  # the two-GPU tests, after the timed parts so they cannot crowd them out
  want_tests=1
  set -- ${*//tests/}
fi
run_tests() {
  [ -n "${want_tests:-}" ] || return 0
  # pytest-timeout (in the GPU image) fails a hung test with every thread's stack instead of losing the run
  timeout_flag=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${TP_TEST_TIMEOUT_S:-240}")
  # -v: a line per test as it ends, so a call cut short still says which tests passed
  python3 -m pytest -m gpu -v -p no:cacheprovider -rfs $timeout_flag tests/gpu/test_all_reduce_gpu.py \
    tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/pytest_tp.log" | tail -15
}
if [ $# -eq 0 ] && [ -n "${ran_part:-}${want_tests:-}" ]; then  # no engine part asked for
  run_tests
  exit 0
fi
# spawned ranks re-import the main module, so it must be a file, not stdin
cat > /tmp/infer_gpu_tp.py <<'EOF'
import faulthandler
import gc
import json
import os
import sys
import time

import torch

from infer.bench.ceilings import decode_step_seconds
from infer.bench.report import format_table, run_workload, warm_up
from infer.bench.workloads import load_workload
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.logging import configure
from infer.core.request import SamplingParams

out_path, num_requests, parts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
dtype = os.environ.get("TP_DTYPE", "bfloat16")
configure(level="warning")
if torch.cuda.device_count() < 2:
    sys.exit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")


def run(label: str, workload: str, num_prompts: int, **options) -> dict:
    return run_many([(label, workload, num_prompts)], **options)[0]


def run_many(jobs: list, **options) -> list:
    """One engine, warmed up, then each (label, workload, num_prompts) job timed in turn."""
    # an engine that takes longer than this (a hang in start-up or teardown) prints every thread's stack
    faulthandler.dump_traceback_later(int(os.environ.get("TP_STACKS_AFTER_S", "240")), repeat=True)
    started = time.perf_counter()
    engine = Engine.from_config(EngineConfig(load_format="dummy", dtype=dtype, **options))
    build_s = time.perf_counter() - started
    results = []
    try:
        vocab = engine.parts.vocab_size
        for label, workload, num_prompts in jobs:
            warm = load_workload(workload, vocab, 4, 8, seed=1)
            warm_up(engine, warm)  # count the measured run only
            record, _ = run_workload(engine, load_workload(workload, vocab, num_prompts, None, seed=0),
                                     SamplingParams(temperature=0), label)
            stats = engine.stats()
            if workload == "latency-1":  # the GPUs' time for a batch-1 step, then where it goes on rank 0
                step_s, kernels = decode_step_seconds(engine, profile=True)
                total = sum(k["critical_us_per_step"] for k in kernels)
                print(f"{label}: decode forward alone {step_s * 1e3:.3f} ms (back to back, graphs); rank 0 kernels "
                      f"{total / 1e3:.3f} ms per step (critical: what each adds to the step; own: its span):", flush=True)
                for k in sorted(kernels, key=lambda k: -k["critical_us_per_step"])[:16]:
                    print(f"    {k['critical_us_per_step']:8.1f} us critical  {k['us_per_step']:8.1f} us own  "
                          f"x{k['count_per_step']:4.0f}  {k['kernel']}", flush=True)
            print(f"{label}: built in {build_s:.0f} s, {record.output_tokens_per_s:.1f} output tok/s, "
                  f"TPOT p50 {record.tpot_p50_s * 1e3:.2f} ms, KV blocks {engine.parts.describe['kv_blocks']}, "
                  f"all-reduce {engine.parts.describe.get('all_reduce', '-')}, pipelined steps "
                  f"{stats.get('pipelined_steps', 0)} (misses {stats.get('pipeline_misses', 0)})", flush=True)
            results.append({**record.to_dict(), "build_s": build_s, "record": record, "engine_stats": engine.stats()})
        return results
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    results: dict[str, dict] = {}
    if "70b" in parts and "spec" not in parts:
        results["llama2-70b tp2 sharegpt-like"] = run("llama2-70b tp2 sharegpt-like", "sharegpt-like", num_requests,
                                                      model="llama2-70b", tensor_parallel_size=2)
    if "7b" in parts:
        for tp in (1, 2):
            results[f"llama2-7b tp{tp} latency-1"] = run(f"llama2-7b tp{tp} latency-1", "latency-1", 1,
                                                         model="llama2-7b", tensor_parallel_size=tp)
        for choice in os.environ.get("TP_CHOICES", "nccl flashinfer").split():
            try:
                results[f"llama2-7b tp2 latency-1 {choice}"] = run(f"llama2-7b tp2 latency-1, --all-reduce {choice}",
                                                                   "latency-1", 1, model="llama2-7b",
                                                                   tensor_parallel_size=2, all_reduce=choice)
            except Exception as exc:  # a strategy that cannot run here is reported, the rest goes on
                print(f"llama2-7b tp2 --all-reduce {choice}: {type(exc).__name__}: {exc}", flush=True)
    if "spec" in parts:  # the 70b engine once: latency-1, then sharegpt-like when "70b" is asked too
        jobs = [("llama2-70b tp2 latency-1", "latency-1", 1)]
        if "70b" in parts:
            jobs.append(("llama2-70b tp2 sharegpt-like", "sharegpt-like", num_requests))
        done = run_many(jobs, model="llama2-70b", tensor_parallel_size=2)
        base = done[0]
        if "70b" in parts:
            results["llama2-70b tp2 sharegpt-like"] = done[1]
        spec = run("llama2-70b tp2 speculative, draft llama2-7b, K=4, latency-1", "latency-1", 1, model="llama2-70b",
                   tensor_parallel_size=2, decoding="speculative", draft="llama2-7b", num_speculative_tokens=4)
        results["llama2-70b tp2 latency-1"], results["llama2-70b tp2 speculative llama2-7b"] = base, spec
        stats, steps = spec["engine_stats"], max(spec["steps"], 1)
        print(f"70b/7b speculative at tp 2: target step {base['tpot_p50_s'] * 1e3:.2f} ms, per spec step: draft K=4 "
              f"{stats.get('spec_draft_s', 0) / steps * 1e3:.2f} ms, verify {stats.get('spec_verify_s', 0) / steps * 1e3:.2f} ms; "
              f"acceptance {stats.get('acceptance_rate')}; {spec['output_tokens_per_s']:.1f} vs "
              f"{base['output_tokens_per_s']:.1f} output tok/s", flush=True)

    print()
    print(format_table([r.pop("record") for r in results.values()]))
    print()
    for label, r in results.items():
        print(f"{label:32s} {r['output_tokens_per_s']:9.1f} output tok/s  {r['total_tokens_per_s']:9.1f} total tok/s  "
              f"TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms")
    if "7b" in parts:
        tp1 = results["llama2-7b tp1 latency-1"]
        for label in [k for k in results if k.startswith("llama2-7b tp2 latency-1")]:
            tp2 = results[label]
            speedup = tp1["tpot_p50_s"] / tp2["tpot_p50_s"]
            print(f"{label}: per-token speedup over tp1 {speedup:.2f}x "
                  f"({tp1['tpot_p50_s'] * 1e3:.2f} ms -> {tp2['tpot_p50_s'] * 1e3:.2f} ms per token)")
            results[f"speedup {label}"] = {"value": speedup}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"wrote {out_path}")


if __name__ == "__main__":  # the ranks are spawned: they must not run this again
    main()
EOF
parts=${*:-70b 7b}
name=tp-${parts// /-}  # one word: a file name with a space does not come back from the device
python3 /tmp/infer_gpu_tp.py "$OUT/$name.json" "${TP_REQUESTS:-200}" $parts 2>&1 | tee "$OUT/$name.log"
run_tests
