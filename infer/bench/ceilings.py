"""Ceilings measured in the same process as the figures they bound."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from infer.kernels.timing import captured_seconds, graph_replay_seconds, seconds_per_call

__all__ = ["captured_seconds", "graph_replay_seconds", "seconds_per_call"]  # the kernels' timers, re-exported


def copy_bandwidth(device: torch.device, num_bytes: int = 2 * 2**30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda: dst.copy_(src), iters, warmup=3)
    return 2 * num_bytes / seconds


def weight_streams(
    project: Callable[[str, int], object], names: Iterable[str], calls: int, layer_bytes: int, bandwidth: float
) -> dict[str, float]:
    """One layer's weight streams against the copy `bandwidth`: `project(name, i)` runs projection
    `name` of layer i (i < `calls`, distinct weights so that none is served from L2). The layer's
    projections, then each alone, captured back to back in a CUDA graph (as a decode step runs them):
    the layer's and each projection's microseconds, and the layer's `layer_bytes` over its time as
    GB/s and as a ratio to `bandwidth`."""
    names = list(names)

    def one_layer(i: int) -> None:
        for name in names:
            project(name, i)

    seconds = captured_seconds(one_layer, calls=calls)
    per = {name: captured_seconds(lambda i, name=name: project(name, i), calls=calls) for name in names}
    return {
        "layer_us": seconds * 1e6,
        "layer_bytes": layer_bytes,
        "achieved_gbps": layer_bytes / seconds / 1e9,
        "ratio_to_copy": layer_bytes / seconds / bandwidth,
        "copy_gbps": bandwidth / 1e9,
        **{f"{name}_us": s * 1e6 for name, s in per.items()},
    }


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def decode_step_seconds(
    engine: "object", context: int = 256, iters: int = 50, profile: bool = False
) -> tuple[float, list[dict]]:
    """Seconds per batch-1 decode forward, run back to back through the engine's runner with CUDA
    graphs: under tensor parallelism each forward goes to every rank, as in a real step, so this is
    the GPUs' time for a step without the scheduler and sampler. With `profile`, also the kernels of
    five such forwards on this rank (`kernel_times`). Writes K/V into one position of free blocks: run
    it after the measured work."""
    from infer.api.runner import StepInputs

    runner = engine.decoder.runner
    size = engine.parts.config.block_size
    table = list(range(1, -(-context // size) + 1))
    step = StepInputs([11], [1], [context], [table], [0], runner.num_layers, True)

    def forward() -> None:
        with runner.executor.forwarding(step):
            runner.run(step)

    seconds = seconds_per_call(forward, iters, warmup=3)
    return seconds, kernel_times(forward) if profile else []


def kernel_times(fn: "Callable[[], object]", steps: int = 5) -> list[dict]:
    """The GPU kernels of `steps` calls of `fn` (torch.profiler; CUPTI also reports the kernels inside
    a replayed CUDA graph), per call: {kernel, count_per_step, us_per_step, critical_us_per_step},
    longest first. `us_per_step` is each kernel's own span: under programmatic dependent launch a
    kernel starts while the one before it runs and waits, so these overlap and sum to more than the
    step. `critical_us_per_step` is what the kernel adds to the step: how far it moves the end of the
    work done so far past where it was (kernels in start order), and sums with the idle gaps (row
    "(idle)") to the span of the calls."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU ops: they would count their kernels again
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return _attribute([e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], steps)


def _attribute(events: list[dict], steps: int) -> list[dict]:
    """Per-name rows from trace events ({name, ts, dur} in microseconds): count, own span and critical
    time per step (see `kernel_times`)."""
    rows: dict[str, dict] = {}
    idle = 0.0
    frontier = None
    for e in sorted(events, key=lambda e: float(e["ts"])):
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        row = rows.setdefault(
            e["name"][:90],
            {"kernel": e["name"][:90], "count_per_step": 0.0, "us_per_step": 0.0, "critical_us_per_step": 0.0},
        )
        row["count_per_step"] += 1 / steps
        row["us_per_step"] += (end - start) / steps
        if frontier is None:
            frontier = start
        idle += max(0.0, start - frontier) / steps
        row["critical_us_per_step"] += max(0.0, end - max(frontier, start)) / steps
        frontier = max(frontier, end)
    out = sorted(rows.values(), key=lambda r: -r["us_per_step"])
    if idle:
        out.append({"kernel": "(idle)", "count_per_step": 0.0, "us_per_step": 0.0, "critical_us_per_step": idle})
    return out
