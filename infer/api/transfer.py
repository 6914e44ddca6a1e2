"""Host lists onto the device without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream:
the host waits for every kernel queued before it. A step that queues forwards back to back (a
draft model's proposal steps, a verify step) would stall on each small index tensor; staging
through pinned memory makes the copy asynchronous (the caching host allocator keeps the buffer
until its copy has run).
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)


def row_index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | slice:
    """An index for dim 0 of a tensor with `total` rows selecting `rows` (sorted, distinct): a plain
    slice when every row is listed, so nothing is copied."""
    return slice(None) if len(rows) == total else to_device(rows, torch.int64, device)
