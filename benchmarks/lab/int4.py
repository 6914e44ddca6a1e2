"""4-bit weights against dense ones (bf16 on a GPU; issue 47): llama3-8b with dummy weights, dense and quantized as it loads
(`--quantization gptq`: RTN, symmetric groups of 128), alternated over --rounds in one process, on latency-1
(batch 1, output tok/s) and random-256x256 (throughput). Prints each pair as a ratio with the figures beside it.

    python -m benchmarks.lab.int4 --rounds 2 --random-prompts 500 [--out int4.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.engines import release_memory
from infer.bench.report import run_workload, warm_up_shaped
from infer.bench.workloads import load_workload
from infer.runtime.builder import make_engine


def one(model: str, quantization: str | None, workload: str, num_prompts: int | None) -> dict[str, Any]:
    started = time.perf_counter()
    engine = make_engine(EngineConfig(model=model, load_format="dummy", quantization=quantization))
    build_s = time.perf_counter() - started
    try:
        wl = load_workload(workload, engine.parts.vocab_size, num_prompts, None, seed=0)
        params = SamplingParams(temperature=0)
        warm_s, _ = warm_up_shaped(engine, wl, params)
        record, _ = run_workload(engine, wl, params, f"{quantization or 'dense'} {workload}")
        return {**record.to_dict(), "build_s": build_s, "warm_up_s": warm_s}
    finally:
        engine.close()
        del engine
        release_memory()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--quantization", default="gptq")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--random-prompts", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for workload, n in (("latency-1", None), ("random-256x256", args.random_prompts)):
            for quant in (None, args.quantization):  # alternated: each pair within one round
                out = one(args.model, quant, workload, n)
                out.update(round=r, workload=workload, quantization=quant or "dense")
                runs.append(out)
                print(
                    f"round {r} {workload:15s} {quant or 'dense':5s} {out['output_tokens_per_s']:10.1f} out tok/s",
                    flush=True,
                )
    for workload in ("latency-1", "random-256x256"):
        last = [x for x in runs if x["workload"] == workload and x["round"] == args.rounds - 1]
        base = next(x for x in last if x["quantization"] == "dense")["output_tokens_per_s"]
        quant = next(x for x in last if x["quantization"] != "dense")["output_tokens_per_s"]
        print(
            f"{workload}: {args.quantization} {quant:.1f} / dense {base:.1f} out tok/s = {quant / base:.2f}x (last round)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2, default=str))


if __name__ == "__main__":
    main()
