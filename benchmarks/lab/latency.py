"""How close is batch-1 decode to the bandwidth floor, and where does the rest of a step go? On the
GPU: the linear layers' matrix-vector products (cuBLAS vs the Triton GEMV) against the copy ceiling,
the kernels inside the captured step, and the step time of `latency-1` on llama2-7b (dummy, bf16)
with each linear implementation.

    python -m benchmarks.lab.latency --out latency.json [--model llama2-7b] [--tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from benchmarks.lab.graphs import decode_graph
from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.ceilings import (
    captured_seconds,
    copy_bandwidth,
    graph_replay_seconds,
    kernel_times,
    kv_bytes_per_token,
)
from infer.bench.engines import release_memory
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import Workload
from infer.core.engine import Engine
from infer.kernels import gemv as triton_gemv
from infer.kernels.gemv import gemv
from infer.plugins.layer import fused as fused_layers
from infer.runtime.builder import make_engine

SHAPES = {
    "qkv": (12288, 4096),
    "o": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
    "lm_head": (32000, 4096),
}


def gemv_table(bw: float) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(200e6 // (n * k * 2)) + 1)  # more weight bytes than L2 holds, rotated
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemv(x, ws[0])  # autotune outside the graph
        torch.testing.assert_close(gemv(x, ws[1]), F.linear(x, ws[1]), atol=2e-2, rtol=2e-2)
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "weight_mb": n * k * 2 / 1e6}
        for impl, f in (
            ("cublas", lambda i: F.linear(x, ws[i % copies])),
            ("triton", lambda i: gemv(x, ws[i % copies])),
        ):
            t = captured_seconds(f)
            row[f"{impl}_us"] = t * 1e6
            row[f"{impl}_tbs"] = n * k * 2 / t / 1e12
            row[f"{impl}_of_copy"] = n * k * 2 / t / bw
        row["triton_config"] = str(triton_gemv.tuned_tiles().get((n, k, x.dtype, x.dtype, x.device, 1)))
        rows.append(row)
        print(
            f"{name:8s} {n:6d}x{k:<6d} cuBLAS {row['cublas_us']:7.1f} us {row['cublas_of_copy']:6.1%}   "
            f"triton {row['triton_us']:7.1f} us {row['triton_of_copy']:6.1%}  [{row['triton_config']}]",
            flush=True,
        )
        ws = []  # the copies go before the next shape is allocated
        torch.cuda.empty_cache()
    return rows


def kernel_profile(engine: Engine) -> list[dict[str, Any]]:
    """Kernels inside the batch-1 decode graph (CUPTI reports graph nodes) over 5 replays."""
    graph = decode_graph(engine)
    graph.replay()
    torch.cuda.synchronize()
    rows = kernel_times(graph.replay)
    total = sum(r["us_per_step"] for r in rows)
    print(f"kernels inside the batch-1 step: {total / 1e3:.3f} ms of kernel time per step")
    for r in rows[:25]:
        print(f"  {r['us_per_step']:8.1f} us  x{r['count_per_step']:5.0f}  {r['kernel']}")
    return rows


def host_profile(engine: Engine, wl: Workload, top: int = 30) -> str:
    """cProfile of the engine loop over one latency-1 request: where the host's share of a step goes."""
    import cProfile
    import io
    import pstats

    engine.add_request(wl.prompts[0], SamplingParams(temperature=0, max_tokens=wl.max_tokens[0], ignore_eos=True))
    engine.step()  # the prefill
    profiler = cProfile.Profile()
    steps = 0
    profiler.enable()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
    text = f"{steps} decode steps\n" + buf.getvalue()
    print(text[:6000])
    return text


@contextlib.contextmanager
def linear_layers(linear: str) -> Iterator[None]:
    """Inside: engines built with `linear` "cublas" run every fused linear layer as torch's
    (cuBLAS at one token too; the down projection's gated GEMV stays); "triton" changes nothing."""
    saved = fused_layers.FusedLinear.forward
    if linear == "cublas":
        fused_layers.FusedLinear.forward = torch.nn.Linear.forward
    try:
        yield
    finally:
        fused_layers.FusedLinear.forward = saved


def latency(
    model: str, tokens: int, linear: str, bw: float, profile_kernels: bool, pipeline: bool = True
) -> dict[str, Any]:
    with linear_layers(linear):
        return _latency(model, tokens, linear, bw, profile_kernels, pipeline)


def _latency(model: str, tokens: int, linear: str, bw: float, profile_kernels: bool, pipeline: bool) -> dict[str, Any]:
    engine = make_engine(
        EngineConfig(
            model=model, load_format="dummy", dtype="bfloat16", kv_cache_memory_gib=4.0, pipeline_decode=pipeline
        )
    )
    try:
        import random

        rng = random.Random(0)
        vocab = engine.parts.vocab_size
        warm = Workload("warm", [[rng.randrange(10, vocab) for _ in range(64)]], [8], ignore_eos=True)
        warm_up(engine, warm)
        wl = Workload("latency-1", [[rng.randrange(10, vocab) for _ in range(128)]], [tokens], ignore_eos=True)
        record, _ = run_workload(engine, wl, SamplingParams(temperature=0), f"latency-{linear}-pipeline-{pipeline}")
        out = record.to_dict()
        replay = graph_replay_seconds(decode_graph(engine))
        weights = engine.parts.describe["weight_bytes"]
        mc = engine.parts.model_config
        kv = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16) * (128 + tokens // 2)
        step_bytes = weights + kv  # BENCHMARKS.md: weight bytes + KV bytes read per step (mean context)
        stats = engine.stats()
        out.update(
            linear=linear,
            pipeline=pipeline,
            graph_replay_s=replay,
            weight_bytes=weights,
            kv_bytes=kv,
            graph_mbu=step_bytes / replay / bw,
            mbu=step_bytes / out["tpot_p50_s"] / bw,
            pipeline_hits=stats.get("pipelined_steps", 0),
            pipeline_misses=stats.get("pipeline_misses", 0),
        )
        print(
            f"latency-1 {model} linear={linear} pipeline={pipeline}: TPOT p50 {out['tpot_p50_s'] * 1e3:.3f} ms (MBU {out['mbu']:.1%}), "
            f"graph replay {replay * 1e3:.3f} ms (MBU {out['graph_mbu']:.1%}), host share "
            f"{(out['tpot_p50_s'] - replay) * 1e3:.3f} ms; pipelined steps {out['pipeline_hits']}, missed {out['pipeline_misses']}",
            flush=True,
        )
        if profile_kernels:
            out["kernels"] = kernel_profile(engine)
            out["host_profile"] = host_profile(engine, wl)
        return out
    finally:
        engine.close()
        del engine
        release_memory()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="latency.json")
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--skip-gemv", action="store_true")
    parser.add_argument("--skip-cublas", action="store_true", help="skip the cuBLAS-linear baseline engine")
    args = parser.parse_args(argv)
    started = time.time()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bw}
    if not args.skip_gemv:
        result["gemv"] = gemv_table(bw)
    result["latency"] = (
        [] if args.skip_cublas else [latency(args.model, args.tokens, "cublas", bw, False, pipeline=False)]
    )
    result["latency"] += [
        latency(args.model, args.tokens, "triton", bw, False, pipeline=False),
        latency(args.model, args.tokens, "triton", bw, True, pipeline=True),
    ]
    result["seconds"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
