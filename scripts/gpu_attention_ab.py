"""Batch-1 decode on the GPU, end to end, with paged-cuda's attention in its one-kernel form
(`fused_reduce`, `fused_cache_write`) and in its three-kernel form, alternately, in one process.

    python scripts/gpu_attention_ab.py [--model llama2-7b] [--rounds 3]

Per form and round: latency-1's TPOT p50 and the replay time of the batch-1 decode graph (the GPU's
time alone for a step). Prints one line per run and the medians last.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from infer.bench.ceilings import graph_replay_seconds
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import load_workload
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.request import SamplingParams
from infer.plugins.attention.paged_cuda import PagedCudaAttention

FORMS = {
    "paged-cuda-3-kernels": dict(fused_reduce=False, fused_cache_write=False),
    "paged-cuda-1-kernel": dict(fused_reduce=True, fused_cache_write=True),
}


def form(opts: dict[str, bool]) -> type:
    class Form(PagedCudaAttention):
        def __init__(self, spec, **kw) -> None:
            super().__init__(spec, **{**opts, **kw})
    return Form


class Forms:
    @hookimpl
    def infer_register_attention_backends(self, register) -> None:
        for name, opts in FORMS.items():
            register(name, form(opts))


def one_run(model: str, attention: str) -> tuple[float, float]:
    engine = Engine.from_config(EngineConfig(model=model, load_format="dummy", dtype="bfloat16", attention=attention,
                                             kv_cache_memory_gib=8), extra_plugins=[Forms()])
    try:
        warm_up(engine, load_workload("latency-1", engine.parts.vocab_size, 4, 8, seed=1))
        record, _ = run_workload(engine, load_workload("latency-1", engine.parts.vocab_size, None, None, seed=0),
                                 SamplingParams(temperature=0), attention)
        replay = graph_replay_seconds(engine.decoder.runner.graphs.graphs[1][0], iters=200)
        return record.tpot_p50_s, replay
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in FORMS}
    for r in range(args.rounds):
        for name in FORMS:
            tpot, replay = one_run(args.model, name)
            seen[name].append((tpot, replay))
            print(f"round {r} {name}: TPOT p50 {tpot * 1e3:.3f} ms, graph replay {replay * 1e3:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {args.model}, latency-1, bf16, medians of {args.rounds}:")
    for name, runs in seen.items():
        print(f"{name:24s} TPOT p50 {statistics.median(t for t, _ in runs) * 1e3:.3f} ms   "
              f"graph replay {statistics.median(g for _, g in runs) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
