"""Tensor parallelism's all-reduce: which one a run uses for small tensors (`--all-reduce`), and why.

`make_all_reduce` asks every rank whether FlashInfer's fused all-reduce (`flashinfer_fused`) or
PyTorch's symmetric memory (`symm_mem`) can run there, and sets up the first that every rank can
use; larger tensors, and runs where neither can, stay with NCCL (gloo on the CPU). Both sum over the
GPUs' peer memory, so both need the ranks on one host with peer access between their GPUs.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.api.errors import ConfigError
from infer.distributed.state import torchrun_host


def peer_gpus_reason(device: torch.device, world_size: int) -> str | None:
    """Why an all-reduce over the GPUs' peer memory cannot run here (None: it can try)."""
    if device.type != "cuda":
        return f"it needs CUDA devices (this run is on {device.type})"
    if world_size < 2:
        return "it needs --tp 2 or more"
    return None


def peer_access_reason(parallel: Any) -> str | None:
    """Why this rank's GPU cannot map the other ranks' memory (None: it can): the ranks span several
    hosts (torchrun's LOCAL_WORLD_SIZE below the world), or a GPU of this host's ranks has no peer
    access to this one (no NVLink or PCIe peer path)."""
    if parallel.device.type != "cuda" or not parallel.is_parallel:
        return None
    local_world, local_rank = torchrun_host() or (parallel.world_size, parallel.rank)
    if local_world < parallel.world_size:
        return (
            f"the {parallel.world_size} ranks span several hosts ({local_world} on this one), and peer "
            "memory is one host's"
        )
    here = parallel.device.index if parallel.device.index is not None else torch.cuda.current_device()
    first = here - local_rank  # the ranks' GPUs are consecutive
    for other in range(first, first + local_world):
        if other != here and not torch.cuda.can_device_access_peer(here, other):
            return f"GPU {here} has no peer access to GPU {other} (no NVLink or PCIe peer path between them)"
    return None


def make_all_reduce(choice: str, parallel: Any, dtype: torch.dtype, hidden_size: int) -> tuple[Any, str]:
    """The fast path for `--all-reduce CHOICE` on this rank (every rank calls this, in the same order)
    for a model whose activations are `dtype` x `hidden_size`, and a line saying what was chosen.
    `auto` takes FlashInfer's fused all-reduce where it can run, else symmetric memory, else NCCL,
    saying why; `symm-mem` and `flashinfer` fail with the reason."""
    backend = "nccl" if parallel.device.type == "cuda" else "gloo"
    if choice == "nccl" or not parallel.is_parallel:
        return None, backend
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce
    from infer.distributed.all_reduce import symm_mem as symmetric_memory

    strategies = {"flashinfer": flashinfer_all_reduce, "symm-mem": symmetric_memory}
    reasons = []
    no_peers = peer_access_reason(parallel)  # both sum over the GPUs' peer memory
    for name in [choice] if choice != "auto" else list(strategies):
        strategy = strategies[name]
        # may differ by rank
        reason = no_peers or strategy.unavailable_reason(parallel.device, parallel.world_size, dtype)
        if strategy is symmetric_memory:  # collective: every rank asks, whatever its own reason
            mismatch = symmetric_memory.rendezvous_mismatch(parallel)
            reason = reason or mismatch
        # every rank must agree before the collective set-up (one rank waiting in it alone would hang)
        if parallel.min(int(reason is None)):
            return _set_up(name, parallel, dtype, hidden_size)
        if choice != "auto":
            fix = "auto or nccl" if choice == "flashinfer" else "nccl"
            raise ConfigError(
                f"--all-reduce {choice} cannot run: {reason or 'another rank cannot use it'}; use --all-reduce {fix}"
            )
        label = "flashinfer" if name == "flashinfer" else "symmetric memory"
        reasons.append(f"{label} unavailable: {reason or 'on another rank'}")
    return None, f"{backend} ({'; '.join(reasons)})"


def _set_up(name: str, parallel: Any, dtype: torch.dtype, hidden_size: int) -> tuple[Any, str]:
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce
    from infer.distributed.all_reduce import symm_mem as symmetric_memory

    if name == "flashinfer":
        fast = flashinfer_all_reduce.FlashInferAllReduce(parallel, hidden_size, dtype)
        return fast, (
            f"flashinfer (one- or two-shot, fused with the residual add and RMSNorm) up to "
            f"{fast.max_tokens} tokens, nccl above"
        )
    try:
        fast = symmetric_memory.SymmetricAllReduce(parallel.group, parallel.device)
    except Exception as exc:  # set-up failed on this rank: the others may have failed too, or may wait
        raise ConfigError(
            f"the symmetric-memory all-reduce could not be set up ({type(exc).__name__}: {exc}); use --all-reduce nccl"
        ) from exc
    return fast, f"symm-mem one-shot up to {fast.max_bytes // 1024} KiB, nccl above"
