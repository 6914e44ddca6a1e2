"""How fast is infer end to end on the BENCHMARKS.md workloads, against HF transformers and the copy
ceiling measured in the same process? On one GPU: latency-1 (with its memory-bandwidth utilisation),
random-256x256 and sharegpt-like, then the HF peers. Prints a table last and writes JSON.

    python -m benchmarks.lab.throughput --out results.json [--quick] [--only latency,random,sharegpt,peers]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from benchmarks.lab.graphs import decode_graph
from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.ceilings import copy_bandwidth, graph_replay_seconds, kv_bytes_per_token
from infer.bench.engines import release_memory
from infer.bench.peers import build_hf_model, hf_continuous, hf_static
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import load_workload
from infer.runtime.builder import make_engine

# (model, workload, requests (None: --peer-requests), static batch sizes, with continuous batching)
PEER_RUNS = (
    ("llama2-7b", "latency-1", 1, [1], False),
    ("llama3-8b", "random-256x256", None, [64], True),
    ("llama2-7b", "sharegpt-like", None, [64], True),
)


def run_infer(name: str, workload: str, num_prompts: int | None, **opts: Any) -> dict[str, Any]:
    config = EngineConfig(load_format="dummy", **opts)
    started = time.perf_counter()
    engine = make_engine(config)
    build_s = time.perf_counter() - started
    try:
        wl = load_workload(workload, engine.parts.vocab_size, num_prompts, None, seed=0)
        warm = load_workload(workload, engine.parts.vocab_size, 4, 8, seed=1)  # compile kernels, warm allocator
        warm_up(engine, warm)
        record, _ = run_workload(engine, wl, SamplingParams(temperature=0), name)
        out = record.to_dict()
        out["build_s"] = build_s
        graph = decode_graph(engine)
        if graph is not None:  # the GPU time of a batch-1 decode step alone
            out["graph_replay_batch1_s"] = graph_replay_seconds(graph)
        mc = engine.parts.model_config
        out["kv_bytes_per_token"] = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
        return out
    finally:
        engine.close()
        del engine
        release_memory()


def run_peers(
    preset: str, workload: str, num_prompts: int, batch_sizes: list[int], with_cb: bool
) -> list[dict[str, Any]]:
    from infer.plugins.model.llama import PRESETS

    model = build_hf_model(PRESETS[preset], torch.bfloat16, torch.device("cuda"))
    wl = load_workload(workload, PRESETS[preset]["vocab_size"], num_prompts, None, seed=0)
    prompts = [list(p) for p in wl.prompts]  # type: ignore[arg-type]
    records = []
    try:
        for bs in batch_sizes:
            n = min(len(prompts), max(bs, 2 * bs if bs > 1 else 1))
            warm = hf_static(model, prompts[:1], [4], 1)
            del warm
            r = hf_static(model, prompts[:n], wl.max_tokens[:n], bs)
            records.append({**r.to_dict(), "model": preset, "workload": workload})
            while r.error and r.error.startswith("out of memory") and bs > 1:  # the largest static batch that fits
                bs //= 2
                r = hf_static(model, prompts[:n], wl.max_tokens[:n], bs)
                records.append({**r.to_dict(), "model": preset, "workload": workload})
        if with_cb:  # generate_batch takes one length for all: the workload's mean where lengths vary
            length = round(sum(wl.max_tokens[: len(prompts)]) / len(prompts))
            r = hf_continuous(model, prompts, length)
            records.append({**r.to_dict(), "model": preset, "workload": workload, "max_new_tokens": length})
    finally:
        del model
        release_memory()
    return records


def infer_runs(args: argparse.Namespace, parts: set[str], bw: float) -> list[dict[str, Any]]:
    """infer's own runs, each printed as soon as it is known (a cut-short run still reports them)."""
    n_big = 128 if args.quick else 1000
    common = dict(attention=args.attention, kv_cache_memory_gib=args.kv_cache_memory, dtype="bfloat16")
    runs: list[dict[str, Any]] = []
    if "latency" in parts:
        r = run_infer("llama2-7b latency-1", "latency-1", None, model="llama2-7b", **common)
        step_s = r["tpot_p50_s"]
        ctx = 128 + 128  # mean context over the 256 decode steps
        step_bytes = r["config"]["weight_bytes"] + ctx * r["kv_bytes_per_token"]
        r["mbu"] = step_bytes / step_s / bw if step_s else 0.0
        if "graph_replay_batch1_s" in r:  # what the GPU alone reaches, without the host's share of a step
            r["graph_mbu"] = step_bytes / r["graph_replay_batch1_s"] / bw
        runs.append(r)
    if "random" in parts:
        runs.append(run_infer("llama3-8b random-256x256", "random-256x256", n_big, model="llama3-8b", **common))
    if "sharegpt" in parts:
        runs.append(run_infer("llama2-7b sharegpt-like", "sharegpt-like", n_big, model="llama2-7b", **common))
    for r in runs:
        print(
            f"{r['label']}: {r['output_tokens_per_s']:.0f} out tok/s, TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms"
            + (f", MBU {r['mbu']:.0%}" if "mbu" in r else ""),
            flush=True,
        )
    return runs


def peer_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    n_peer = args.peer_requests or (64 if args.quick else 128)
    peers: list[dict[str, Any]] = []
    for model, workload, n, batches, cb in PEER_RUNS:
        if workload not in args.peers.split(","):
            continue
        done = run_peers(model, workload, n or n_peer, batches, with_cb=cb)
        for p in done:
            print(
                f"{p['label']} {model} {workload} {p['num_requests']} req: {p['output_tokens_per_s']:.0f} out tok/s "
                f"{p['error'] or ''}",
                flush=True,
            )
        peers += done
    return peers


def print_table(device: str, bw: float, runs: list[dict[str, Any]], peers: list[dict[str, Any]]) -> None:
    print(f"\ndevice: {device}  copy bandwidth: {bw / 1e9:.0f} GB/s")
    print(f"{'system':40s} {'req/s':>8s} {'out tok/s':>10s} {'TPOT p50 ms':>12s} {'TTFT p50 ms':>12s} {'extra':>40s}")
    for r in runs:
        extra = f"KV util {r['kv_utilisation']:.0%}"
        if "mbu" in r:
            extra = f"MBU {r['mbu']:.0%}"
            if "graph_mbu" in r:
                extra += f" (GPU alone {r['graph_replay_batch1_s'] * 1e3:.2f} ms, {r['graph_mbu']:.0%})"
        print(
            f"{r['label']:40s} {r['requests_per_s']:8.2f} {r['output_tokens_per_s']:10.0f} "
            f"{r['tpot_p50_s'] * 1e3:12.2f} {r['ttft_p50_s'] * 1e3:12.1f} {extra:>40s}"
        )
    for p in peers:
        label = f"{p['label']} ({p['model']}, {p['num_requests']} req)"
        print(
            f"{label:40s} {p['num_requests'] / p['wall_s'] if p['wall_s'] else 0:8.2f} "
            f"{p['output_tokens_per_s']:10.0f} {'':12s} {'':12s} {(p['error'] or '')[:30]:>30s}"
        )


def print_ratios(runs: list[dict[str, Any]], peers: list[dict[str, Any]]) -> None:
    """infer's output tokens/s over the largest static HF batch that ran, and over HF continuous batching."""
    by = {(p["workload"], p["label"]): p for p in peers}
    for workload, model in (("random-256x256", "llama3-8b"), ("sharegpt-like", "llama2-7b")):
        ours = next((r for r in runs if workload in r["label"]), None)
        static = [
            p
            for p in peers
            if p["workload"] == workload
            and p["label"].startswith("hf-static-")
            and p["label"] != "hf-static-1"
            and not p["error"]
        ]
        for peer in ([static[0]["label"]] if static else []) + ["hf-continuous"]:
            theirs = by.get((workload, peer))
            if ours is not None and theirs is not None and theirs["output_tokens_per_s"] and not theirs["error"]:
                print(
                    f"{workload} {model}: infer {ours['output_tokens_per_s']:.0f} / {peer} "
                    f"{theirs['output_tokens_per_s']:.0f} out tok/s = "
                    f"{ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x"
                )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--only", default="latency,random,sharegpt,peers")
    ap.add_argument("--attention", default="auto")
    ap.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="KV cache GiB (default: the engine's, 90%% of the free GPU memory)",
    )
    ap.add_argument("--peers", default="latency-1,random-256x256,sharegpt-like", help="workloads the HF peers run")
    ap.add_argument(
        "--peer-requests", type=int, default=None, help="requests per peer workload (default 128, 64 with --quick)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parts = set(args.only.split(","))
    device = torch.device("cuda")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth(device)
    results["copy_bandwidth_GBps"] = bw / 1e9
    runs = infer_runs(args, parts, bw)
    peers = peer_runs(args) if "peers" in parts else []
    results["infer"] = runs
    results["peers"] = peers
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print_table(results["device"], bw, runs, peers)
    print_ratios(runs, peers)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
