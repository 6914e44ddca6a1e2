"""A low-latency all-reduce for the small tensors of decode steps, through PyTorch's symmetric memory.

A decode step of a tensor-parallel Llama sums one `[batch, hidden]` activation over the ranks twice per
layer (65 times a step for Llama-2-7B). At batch 1 that is 8 KiB, and NCCL's ring spends most of its
time on protocol rather than bytes. PyTorch's one-shot all-reduce
(`torch.ops.symm_mem.one_shot_all_reduce_copy_out`) is one kernel: each rank copies its input into a
buffer every rank has mapped (CUDA peer memory over NVLink), the ranks meet at a barrier of signal
flags, and each rank reads all the buffers and sums them. It is capturable in CUDA graphs.

Larger tensors (prefill) stay with NCCL, whose bandwidth-optimal algorithms win there; the cut-over
is `max_bytes`. Nothing here uses NVLink multicast (`multimem_*` ops): only peer pointers.

The choice between the two paths depends only on the tensor's shape and dtype, which are the same on
every rank, so the ranks always take the same path and meet in the same collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from infer.distributed.all_reduce import peer_gpus_reason

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel is compiled for
# tensors up to this size go through symmetric memory, larger ones NCCL: the one-shot kernel won up to
# 4 MiB and lost at 8 MiB on two H200s (docs/performance.md, "Symmetric-memory all-reduce")
DEFAULT_MAX_BYTES = 4 << 20
# Rendezvous this process has done. Torch numbers the store keys of its symmetric-memory rendezvous
# with a counter per process (StoreExchange's sequence id), so ranks can rendezvous only while they
# have all done as many: an engine's freshly spawned ranks cannot meet rank 0 once an earlier
# tensor-parallel engine in rank 0's process has used symmetric memory (each waits for keys the
# other never writes). Measured on two H200s: the second such engine hung in `rendezvous`.
_rendezvous_done = 0
ALIGNMENT = 16  # the kernel's vector width in bytes


class SymmetricAllReduce:
    """One symmetric buffer of `max_bytes`, mapped on every rank of `group`; `__call__` sums in place."""

    exchange = None  # one-token steps' sums are not pushed (`FastAllReduce`)
    add_rms_norm = None  # no fused residual add and norm: the norm runs after the sum

    def __init__(self, group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        # torch's symmetric memory changes by version: the function, and its deprecation mark, may be absent
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not getattr(enable, "__deprecated__", None):  # set by newer torch's @deprecated
            # older torch needs it before rendezvous. Newer torch marks it deprecated and must not get it:
            # it caches the group's store under the group's name ("0" for the default group) and returns
            # early when the name is known, so a second engine in this process, whose new group has the
            # same name, would rendezvous through the first engine's store while the other ranks use the
            # new one, and wait forever.
            enable(self.group_name)
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)  # collective: every rank maps every rank's buffer
        global _rendezvous_done
        _rendezvous_done += 1
        ops = torch.ops.symm_mem
        self._copy_out = getattr(ops, "one_shot_all_reduce_copy_out", None)  # copy-in fused: a torch >= 2.8 op
        self._out = ops.one_shot_all_reduce_out

    def fits(self, x: torch.Tensor) -> bool:
        """Same answer on every rank: shape and dtype only."""
        nbytes = x.numel() * x.element_size()
        return x.dtype in SUPPORTED_DTYPES and 0 < nbytes <= self.max_bytes and nbytes % ALIGNMENT == 0

    def close(self) -> None:
        """Nothing to free together: torch keeps the symmetric buffer until the group is destroyed."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)  # a view when x is contiguous, else a copy
        src = flat if flat.data_ptr() % ALIGNMENT == 0 else flat.clone()  # a fresh tensor is aligned: 16-byte vectors
        symm = self.buffer[: src.numel() * src.element_size()].view(src.dtype)
        if self._copy_out is not None:
            self._copy_out(symm, src, "sum", self.group_name, src)
        else:
            symm.copy_(src)
            self._out(symm, "sum", self.group_name, src)
        if src.data_ptr() != x.data_ptr():  # summed in a copy: back into x
            x.copy_(src.view(x.shape))
        return x


def forget_group(group_name: str) -> None:
    """After the process group is destroyed: drop what older torch cached under its name, so the
    next engine's group (which gets the same name) registers its own store."""
    with contextlib.suppress(Exception):
        import torch.distributed._symmetric_memory as symm_mem

        getattr(symm_mem, "_group_name_to_store", {}).pop(group_name, None)  # older torch's private cache only


def unavailable_reason(device: torch.device, world_size: int, dtype: torch.dtype) -> str | None:
    """Why this process cannot sum `dtype` through symmetric memory (None: it can try)."""
    if (reason := peer_gpus_reason(device, world_size)) is not None:
        return reason
    if dtype not in SUPPORTED_DTYPES:
        return (
            f"PyTorch's one-shot kernel has no {str(dtype).removeprefix('torch.')} (it sums bfloat16 and "
            "float32): use --dtype bfloat16"
        )
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"this torch build has no torch.distributed._symmetric_memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):  # a torch op only some builds have
        return "this torch build has no one-shot all-reduce (torch.ops.symm_mem.one_shot_all_reduce_out)"
    return None


def rendezvous_mismatch(parallel: Any) -> str | None:
    """Collective (every rank calls it): why the ranks cannot rendezvous now, when they have done
    different numbers of rendezvous before (None: they agree)."""
    fewest, most = parallel.min(_rendezvous_done), -parallel.min(-_rendezvous_done)
    if fewest == most:
        return None
    return (
        "an earlier tensor-parallel engine in this process set up symmetric memory, and torch counts "
        "rendezvous per process, so this engine's new ranks cannot meet rank 0 (the first engine of a "
        "process can use it): use --all-reduce flashinfer or nccl, or one engine per process"
    )
