"""Ceilings measured in the same process as the figures they bound."""

from __future__ import annotations

from typing import Callable

import torch


def copy_bandwidth(device: torch.device, num_bytes: int = 2 * 2**30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * num_bytes / seconds


def graph_replay_seconds(graph: "torch.cuda.CUDAGraph", iters: int = 50) -> float:
    """Seconds per replay of a captured CUDA graph, back to back (the GPU's time alone for a step)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def captured_seconds(fn: "Callable[[int], object]", calls: int = 20, replays: int = 10) -> float:
    """Seconds per call of `fn(i)`, i = 0 .. calls - 1, captured back to back in one CUDA graph and
    replayed `replays` times between device events (how an engine's graph runs them: no host launch
    cost). A few warm-up calls run first on a side stream (compiles, allocations)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def decode_step_seconds(engine: "object", context: int = 256, iters: int = 50, profile: bool = False) -> tuple[float, list]:
    """Seconds per batch-1 decode forward, run back to back through the engine's runner with CUDA
    graphs: under tensor parallelism each forward goes to every rank, as in a real step, so this is
    the GPUs' time for a step without the scheduler and sampler. With `profile`, also the kernels of
    five such forwards on this rank (torch.profiler), as (name, calls per step, microseconds per step),
    longest first. Writes K/V into one position of free blocks: run it after the measured work."""
    from infer.core.runner import StepInputs

    runner = engine.decoder.runner
    size = engine.parts.config.block_size
    table = list(range(1, -(-context // size) + 1))
    step = StepInputs([11], [1], [context], [table], [0], runner.num_layers, True)
    mirror = getattr(runner.model, "mirror", None)

    def forward() -> None:
        runner.run(step) if mirror is None else mirror.forward(runner, step)

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        forward()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    kernels: list = []
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                forward()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if dev:
                kernels.append((e.key[:80], e.count / 5, dev / 5))
        kernels.sort(key=lambda k: -k[2])
    return seconds, kernels
