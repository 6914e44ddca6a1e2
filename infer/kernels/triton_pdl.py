"""Programmatic dependent launch (PDL) for this project's Triton kernels, on Hopper GPUs and newer.

A decode step is some 350 small kernels, one after another on a stream (in a CUDA graph). Normally
each starts only once the one before has finished and drained, so every boundary costs the launch
of the next grid plus the ramp-up of its first wave. With PDL a kernel is launched as dependent
(`launch_pdl=True`): its blocks may be scheduled while its predecessor's last wave still runs, and
each block first waits (`gdc_wait`, which returns once the predecessor has completed and its writes
are visible), then lets its own dependents be launched (`gdc_launch_dependents`). Every kernel here
waits before it touches anything (the tensor-parallel exchange's reader, `lamport_reduce`, reads
only its peer-written slot before it waits, and writes after), so the results are those of plain
launches whichever kernel comes before (a kernel that never signals, like cuBLAS's or NCCL's, counts as signalling when it
finishes). CUDA graphs keep these launches as programmatic edges.

When it is on: `infer.kernels.pdl` (Hopper and newer, unless INFER_PDL=0), and a Triton that has it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from infer.kernels import pdl

# this Triton has the device-side calls (checked once: use_pdl runs at every kernel launch);
# Triton's modules vary by version: older releases have no tl.extra.cuda
_CUDA = getattr(getattr(tl, "extra", None), "cuda", None)
HAS_GDC = hasattr(_CUDA, "gdc_wait") and hasattr(_CUDA, "gdc_launch_dependents")  # newer Triton's calls only


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (the `USE_PDL` constexpr)."""
    return HAS_GDC and pdl.enabled(device)


def kernel_args(device: torch.device) -> dict[str, Any]:
    """Keywords for launching a kernel on `device`: its `USE_PDL` constexpr, and `launch_pdl` where
    PDL is on."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


@triton.jit
def wait_and_release(USE_PDL: tl.constexpr):
    """First thing in a kernel: wait for the kernel before (its writes visible), then let the next
    kernel's blocks be scheduled. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
