"""GPU time of a call or a captured graph, between device events: what the GEMV tuner and the
benchmarks time kernels with."""

from __future__ import annotations

from typing import Callable

import torch


def seconds_per_call(fn: "Callable[[], object]", iters: int = 50, warmup: int = 1) -> float:
    """Seconds per call of `fn`, called back to back between two device events after `warmup` calls:
    the GPU's time when the host keeps ahead of it."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graph_replay_seconds(graph: "torch.cuda.CUDAGraph", iters: int = 50) -> float:
    """Seconds per replay of a captured CUDA graph, back to back (the GPU's time alone for a step)."""
    return seconds_per_call(graph.replay, iters)


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
    return seconds_per_call(graph.replay, replays) / calls
