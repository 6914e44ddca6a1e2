"""What the benchmarks that build several engines in one process share: handing device memory back
between the engines they build in turn."""

from __future__ import annotations

import gc

import torch


def release_memory() -> None:
    """Collect what a closed engine left and return the CUDA caching allocator's free blocks, so the
    next engine's KV budget (a share of the free memory) does not depend on the one before."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
