"""What a strategy declares it can do, checked before any weight loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a strategy declares it can do; checked before any weight loads."""

    devices: frozenset[str] = frozenset({"cpu", "cuda"})  # device types it runs on
    phases: frozenset[str] = frozenset({"prefill", "decode"})  # attention: which phases it serves
    dtypes: frozenset[torch.dtype] | None = None  # None: any dtype
    block_sizes: frozenset[int] | None = None  # None: any KV block size
    cuda_graph_safe: bool = False  # decode step may be captured in a CUDA graph
    writes_kv_first: bool = False  # attention: a step's K/V all written before any is read (verify rows)
    # decode pipelining. attention: plan() for the next step may run while the step before is still
    # queued (it writes no host memory that queued copies still read); decoder: its steps go through
    # ModelRunner.execute, one token per sequence; a forward it runs itself first takes the one queued
    # ahead (`DecodePipeline.take`, the rows it computed) or drops it (`ModelRunner.discard_ahead`)
    pipeline_safe: bool = False
    needs_draft: bool = False  # decoder: requires --draft
    uses_exit_layer: bool = False  # decoder: requires --exit-layer (the layers it keeps)
    lossy: bool = False  # decoder: changes the outputs (early exit); the run report says so
    distributed: bool = True  # works under tensor parallelism
    sliding_window: bool = False  # attention: honours forward(..., window=W) (see AttentionBackend)
    soft_cap: bool = False  # attention: honours AttentionSpec.soft_cap
    fp8_kv: bool = False  # attention: reads and writes an FP8 KV cache (AttentionSpec.kv_cache_dtype)
    priority: int = 0  # higher wins when a slot is resolved "auto"
    # returns None when runnable here, else the reason (missing library, wrong GPU, ...)
    available: Callable[[], str | None] | None = None

    def describe(self) -> str:
        parts = [f"devices={','.join(sorted(self.devices))}"]
        if self.phases != frozenset({"prefill", "decode"}):
            parts.append(f"phases={','.join(sorted(self.phases))}")
        if self.dtypes is not None:
            parts.append("dtypes=" + ",".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes)))
        if self.block_sizes is not None:
            parts.append("block_sizes=" + ",".join(map(str, sorted(self.block_sizes))))
        if self.cuda_graph_safe:
            parts.append("cuda-graphs")
        if self.pipeline_safe:
            parts.append("pipelined-decode")
        if self.writes_kv_first:
            parts.append("kv-written-first")
        if self.sliding_window:
            parts.append("sliding-window")
        if self.soft_cap:
            parts.append("soft-cap")
        if self.fp8_kv:
            parts.append("fp8-kv")
        if self.needs_draft:
            parts.append("needs-draft")
        if self.lossy:
            parts.append("lossy (changes outputs)")
        return " ".join(parts)


DEFAULT_CAPABILITIES = Capabilities()


def capabilities_of(factory: Any) -> Capabilities:
    # a factory is any class or function; the hooks' contract makes its `capabilities` optional
    return getattr(factory, "capabilities", DEFAULT_CAPABILITIES)
