"""What does a switch read from the environment change in batch-1 decode? llama2-7b latency-1, bf16,
dummy weights, at each setting: by default programmatic dependent launch off and on (INFER_PDL=0,1);
`--vary NAME=V1,V2` for another. Each configuration in its own process (the switches are read once
per process, and symmetric memory serves one tensor-parallel engine per process), in alternating rounds.

    python -m benchmarks.lab.pdl [--tp 1 2] [--all-reduce symm-mem flashinfer] [--vary NAME=V1,V2] [--rounds 2] [--out pdl.json]

Per run: TPOT p50 of latency-1 and the decode forward's device time alone (back to back through
CUDA graphs). Prints a line per run, then the medians and each tp2/tp1 per-token ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from infer.common import env
from infer.runtime.builder import make_engine


def one(tp: int, all_reduce: str) -> dict:
    """In a fresh process whose INFER_PDL is set: build, warm up, time, close."""
    import torch

    from infer.api.config import EngineConfig
    from infer.api.request import SamplingParams
    from infer.bench.ceilings import decode_step_seconds
    from infer.bench.report import run_workload, warm_up
    from infer.bench.workloads import load_workload
    from infer.common.log import configure
    from infer.distributed.launch import launch
    from infer.kernels import triton_pdl

    configure(level="warning")
    engine = make_engine(
        EngineConfig(
            model="llama2-7b",
            load_format="dummy",
            dtype="bfloat16",
            tensor_parallel_size=tp,
            all_reduce=all_reduce,
            kv_cache_memory_gib=8,
        ),
        launch=launch,
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


def run_one(tp: int, all_reduce: str, name: str, setting: str) -> tuple[dict | None, str]:
    """`one` in a child process with the variable `name` set to `setting`: its result, or None and
    why it failed."""
    env.export(name, setting)  # for the child, which reads it once
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.lab.pdl", "--one", str(tp), all_reduce],
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        return None, f"failed ({done.returncode})\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][7:]), ""


def run_rounds(configs: list[tuple[int, str]], name: str, settings: list[str], rounds: int) -> list[dict]:
    """Every (tp, all-reduce) at every setting, round after round; a line per run."""
    runs: list[dict] = []
    for r in range(rounds):
        for tp, ar in configs:
            for setting in settings:
                result, why = run_one(tp, ar, name, setting)
                if result is None:
                    print(f"round {r} tp{tp} {ar} {name}={setting}: {why}", flush=True)
                    continue
                run = {**result, "round": r, "asked_all_reduce": ar, name: setting}
                runs.append(run)
                print(
                    f"round {r} tp{tp} {ar:10s} {name}={setting} pdl={run['pdl']!s:5s} TPOT p50 {run['tpot_p50_ms']:.3f} ms, "
                    f"forward {run['forward_ms']:.3f} ms ({run['all_reduce']})",
                    flush=True,
                )
    return runs


def print_medians(runs: list[dict], configs: list[tuple[int, str]], name: str, settings: list[str]) -> None:
    """Per configuration and setting, the medians over rounds; then each tp > 1 against tp1."""
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.pdl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--all-reduce", nargs="+", default=["symm-mem", "flashinfer"], help="for tp > 1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="pdl.json")
    ap.add_argument("--vary", default="INFER_PDL=0,1", help="NAME=V1,V2,...: the environment variable set per run")
    ap.add_argument("--one", nargs=2, metavar=("TP", "ALL_REDUCE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(int(args.one[0]), args.one[1])), flush=True)
        return
    configs = [(tp, ar) for tp in args.tp for ar in (["nccl"] if tp == 1 else args.all_reduce)]
    name, _, values = args.vary.partition("=")
    settings = values.split(",")
    runs = run_rounds(configs, name, settings, args.rounds)
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=2)
    print_medians(runs, configs, name, settings)


if __name__ == "__main__":
    main()
