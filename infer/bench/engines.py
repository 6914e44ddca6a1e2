"""What the GPU measurements in infer/bench share: handing device memory back between the engines
one process builds in turn, and the engine's captured decode step."""

from __future__ import annotations

import gc
from typing import Any

import torch


def release_memory() -> None:
    """Collect what a closed engine left and return the CUDA caching allocator's free blocks, so the
    next engine's KV budget (a share of the free memory) does not depend on the one before."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_graph(engine: Any, num_seqs: int = 1) -> torch.cuda.CUDAGraph | None:
    """The CUDA graph the engine replays for a decode step of `num_seqs` sequences, or None where it
    captured none (CUDA graphs off, a CPU engine, a batch size without a bucket of its own)."""
    graphs = engine.parts.runners[0].graphs  # the target's runner; a CudaGraphRunner, or None
    if graphs is None or num_seqs not in graphs.graphs:
        return None
    return graphs.graphs[num_seqs][0]
