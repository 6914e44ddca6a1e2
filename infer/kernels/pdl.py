"""Whether kernels launch as programmatic dependents (PDL) on a device: on a GPU of compute
capability 9.0 or newer outside the Triton interpreter, unless `INFER_PDL=0`. A dependent kernel's
blocks may be scheduled while the kernel before it finishes; each waits on the GPU for that kernel
before reading anything, so results are those of plain launches. This project's Triton kernels take
it through `infer.kernels.triton_pdl`, FlashInfer's all-reduce through its `launch_with_pdl`.
What PDL saves, and how it was measured: docs/performance.md, "Programmatic dependent launch"."""

from __future__ import annotations

import functools

import torch

from infer.common import env


@functools.cache  # enabled() runs at every kernel launch: the variables are read once per GPU
def _enabled(device_index: int) -> bool:
    if not env.pdl() or env.triton_interpret():
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())


def reset() -> None:
    """Read INFER_PDL again on the next launch (tests and benchmarks that switch it)."""
    _enabled.cache_clear()
