"""The paged KV tensors: per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from infer.core.interfaces import KVCache

CPU_DEFAULT_BUDGET_GIB = 1.0


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(0, budget_bytes // per_block)


def budget_bytes(device: torch.device, kv_cache_memory_gib: float | None, gpu_memory_utilization: float) -> int:
    """KV budget: explicit GiB, else 1 GiB on the CPU, else what is left of the GPU's share."""
    if kv_cache_memory_gib is not None:
        return int(kv_cache_memory_gib * 2**30)
    if device.type != "cuda":
        return int(CPU_DEFAULT_BUDGET_GIB * 2**30)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * gpu_memory_utilization) - used - 512 * 2**20)  # 512 MiB for activations


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
