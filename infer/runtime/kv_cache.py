"""The paged KV tensors: per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim];
how many blocks the memory budget holds, and the check that one full-length request fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infer.core.config import EngineConfig
from infer.core.errors import ConfigError
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


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One model's KV tensors on this rank (every model of a run is indexed by the same block tables)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def check_fits(num_blocks: int, block_size: int, max_model_len: int, lookahead: int, raise_flag: str) -> None:
    """The cache must hold one request of max_model_len (and the decoder's lookahead slots), as vLLM
    requires: a smaller one would end every long request for want of room, after the weights loaded."""
    needed = -(-(max_model_len + lookahead) // block_size)
    if num_blocks >= needed:
        return
    fits = num_blocks * block_size - lookahead
    lower = f", or lower --max-model-len to {fits} or less" if fits >= 1 else ""
    raise ConfigError(
        f"the KV cache holds {num_blocks} block{'s' if num_blocks != 1 else ''} of {block_size} tokens but one "
        f"request of --max-model-len {max_model_len}{f' plus {lookahead} draft tokens' if lookahead else ''} needs {needed}: raise {raise_flag}"
        f"{' to ' + str(needed) if raise_flag == '--num-kv-blocks' else ''}{lower}"
    )


def plan_blocks(
    config: EngineConfig,
    shapes: list[CacheShape],
    max_model_len: int,
    lookahead: int,
    dtype: torch.dtype,
    device: torch.device,
    agree: Callable[[int], int] = lambda n: n,
) -> tuple[int, int]:
    """(device blocks, CPU swap-pool blocks) for `shapes`: --num-kv-blocks, else what the budget holds,
    never more than max_num_seqs full-length requests use. `agree`: the fewest over the
    tensor-parallel ranks, whose caches hold the same blocks."""
    per_block = sum(bytes_per_block(s.num_layers, config.block_size, s.num_kv_heads, s.head_dim, dtype) for s in shapes)
    blocks_per_seq = -(-(max_model_len + config.num_speculative_tokens + 1) // config.block_size)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:  # the device's free memory is read only when no block count is given
        budget = budget_bytes(device, config.kv_cache_memory_gib, config.gpu_memory_utilization)
        num_blocks = min(num_blocks_for_budget(budget, per_block), config.max_num_seqs * blocks_per_seq)
    num_blocks = agree(num_blocks)
    flag = "--num-kv-blocks" if config.num_kv_blocks else "--kv-cache-memory / --gpu-memory-utilization"
    check_fits(num_blocks, config.block_size, max_model_len, lookahead, flag)
    num_cpu_blocks = 0  # the CPU pool for preemption by swap, sized like the device cache (every model's bytes)
    if config.preemption_mode == "swap":
        num_cpu_blocks = min(int(config.swap_space_gib * 2**30) // per_block, config.max_num_seqs * blocks_per_seq)
    return num_blocks, num_cpu_blocks
