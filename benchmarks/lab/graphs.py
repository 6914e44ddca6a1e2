"""The engine's captured decode step, for the lab drivers that time its replay (latency, throughput):
read below the public stepping API, through the target's runner."""

from __future__ import annotations

from typing import Any

import torch


def decode_graph(engine: Any, num_seqs: int = 1) -> torch.cuda.CUDAGraph | None:
    """The CUDA graph the engine replays for a decode step of `num_seqs` sequences, or None where it
    captured none (CUDA graphs off, a CPU engine, a batch size without a bucket of its own)."""
    graphs = engine.parts.runners[0].graphs  # the target's runner; a CudaGraphRunner, or None
    if graphs is None or num_seqs not in graphs.graphs:
        return None
    return graphs.graphs[num_seqs][0]
