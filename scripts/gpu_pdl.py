"""A switch read from the environment at each setting, llama2-7b latency-1, bf16, dummy weights:
by default programmatic dependent launch off and on (INFER_PDL=0,1); `--vary NAME=V1,V2`
for another. Each configuration in its own process (the switches are read once per process, and
symmetric memory serves one tensor-parallel engine per process), in alternating rounds.

    python scripts/gpu_pdl.py [--tp 1 2] [--all-reduce symm-mem flashinfer] [--vary NAME=V1,V2] [--rounds 2] [--out pdl.json]

Per run: TPOT p50 of latency-1 and the decode forward's device time alone (back to back through
CUDA graphs). Prints a line per run, then the medians and each tp2/tp1 per-token ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def one(tp: int, all_reduce: str) -> dict:
    """In a fresh process whose INFER_PDL is set: build, warm up, time, close."""
    import torch

    from infer.bench.ceilings import decode_step_seconds
    from infer.bench.report import run_workload, warm_up
    from infer.bench.workloads import load_workload
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.logging import configure
    from infer.core.request import SamplingParams
    from infer.kernels import triton_pdl

    configure(level="warning")
    engine = Engine.from_config(
        EngineConfig(
            model="llama2-7b",
            load_format="dummy",
            dtype="bfloat16",
            tensor_parallel_size=tp,
            all_reduce=all_reduce,
            kv_cache_memory_gib=8,
        )
    )
    try:
        vocab = engine.parts.vocab_size
        warm_up(engine, load_workload("latency-1", vocab, 4, 8, seed=1))
        record, _ = run_workload(
            engine, load_workload("latency-1", vocab, None, None, seed=0), SamplingParams(temperature=0), "latency-1"
        )
        forward_s, _ = decode_step_seconds(engine)
        return {
            "tp": tp,
            "all_reduce": engine.parts.describe.get("all_reduce", "-"),
            "pdl": triton_pdl.use_pdl(torch.device("cuda", 0)),
            "tpot_p50_ms": record.tpot_p50_s * 1e3,
            "forward_ms": forward_s * 1e3,
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--all-reduce", nargs="+", default=["symm-mem", "flashinfer"], help="for tp > 1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="pdl.json")
    ap.add_argument("--vary", default="INFER_PDL=0,1", help="NAME=V1,V2,...: the environment variable set per run")
    ap.add_argument("--one", nargs=2, metavar=("TP", "ALL_REDUCE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(int(args.one[0]), args.one[1])), flush=True)
        return
    configs = [(tp, ar) for tp in args.tp for ar in (["nccl"] if tp == 1 else args.all_reduce)]
    name, _, values = args.vary.partition("=")
    settings = values.split(",")
    runs: list[dict] = []
    for r in range(args.rounds):
        for tp, ar in configs:
            for setting in settings:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", str(tp), ar],
                    capture_output=True,
                    text=True,
                    env={**os.environ, name: setting},
                )
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                if done.returncode or not lines:
                    print(
                        f"round {r} tp{tp} {ar} {name}={setting}: failed ({done.returncode})\n{done.stderr[-3000:]}",
                        flush=True,
                    )
                    continue
                run = {**json.loads(lines[-1][7:]), "round": r, "asked_all_reduce": ar, name: setting}
                runs.append(run)
                print(
                    f"round {r} tp{tp} {ar:10s} {name}={setting} pdl={run['pdl']!s:5s} TPOT p50 {run['tpot_p50_ms']:.3f} ms, "
                    f"forward {run['forward_ms']:.3f} ms ({run['all_reduce']})",
                    flush=True,
                )
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=2)
    print("\nmedians:")
    medians: dict[tuple, float] = {}
    for tp, ar in configs:
        for setting in settings:
            mine = [x for x in runs if x["tp"] == tp and x["asked_all_reduce"] == ar and x[name] == setting]
            if mine:
                tpot = statistics.median(x["tpot_p50_ms"] for x in mine)
                medians[(tp, ar, setting)] = tpot
                print(
                    f"tp{tp} {ar:10s} {name}={setting}: TPOT p50 {tpot:.3f} ms, forward "
                    f"{statistics.median(x['forward_ms'] for x in mine):.3f} ms ({len(mine)} runs)"
                )
    for (tp, ar, setting), tpot in medians.items():
        base = medians.get((1, "nccl", setting))
        if tp > 1 and base:
            print(
                f"tp{tp} {ar} {name}={setting}: per-token speedup over tp1 (same {name}) {base / tpot:.3f}x "
                f"({base:.3f} -> {tpot:.3f} ms)"
            )


if __name__ == "__main__":
    main()
