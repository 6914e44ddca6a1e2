"""The paged KV tensors: per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim];
their dtype (the model's, or FP8 with a scale per layer), how many blocks the memory budget holds,
the check that one full-length request fits, and every model's cache of a run allocated with the
block mover over them (`build_kv_caches`, which the builder calls)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from infer.api import Communicator, KVCache
from infer.api.config import EngineConfig, KVCacheDtype
from infer.api.errors import ConfigError
from infer.api.kv_cache import FP8, FP8KVCache
from infer.core.block_mover import BlockMover

if TYPE_CHECKING:
    from infer.runtime.runner import ModelRunner

CPU_DEFAULT_BUDGET_GIB = 1.0


def kv_cache_dtype(choice: KVCacheDtype, dtype: torch.dtype) -> torch.dtype:
    """The KV tensors' dtype for --kv-cache-dtype `choice` and a model running in `dtype`."""
    return FP8 if choice == "fp8" else dtype


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


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One model's KV tensors on this rank (every model of a run is indexed by the same block tables)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def allocate_kv_cache(
    shape: CacheShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    scales: Sequence[tuple[float, float]] | None = None,  # FP8: (k_scale, v_scale) per layer; None: 1.0
) -> list[KVCache]:
    size = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    caches: list[KVCache] = []
    for layer in range(shape.num_layers):
        if dtype == FP8:  # zero bytes are e4m3 zeros
            k, v = (torch.zeros(size, dtype=torch.uint8, device=device).view(FP8) for _ in "kv")
            caches.append(FP8KVCache(k, v, *(scales[layer] if scales else (1.0, 1.0))))
        else:
            caches.append(
                (torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device))
            )
    return caches


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


def _layers_here(runner: ModelRunner, model_config: Any) -> int:
    """The layers whose KV this process holds for `runner`: a pipeline stage's, or those that run."""
    if runner.stages is not None:
        return runner.stages.stage.end - runner.stages.stage.start
    return runner.num_layers or model_config.num_layers


def build_kv_caches(
    config: EngineConfig,
    models: Sequence[tuple[ModelRunner, Any]],  # (runner, its ModelConfig) per model, target first
    parallel: Communicator,
    max_model_len: int,
    lookahead: int,  # the decoder's KV slots past the new tokens
    model_dtype: torch.dtype,
    device: torch.device,
) -> tuple[int, BlockMover]:
    """Every model's KV cache, the same number of blocks (one more: the null block) indexed by the same
    block tables, within the budget; and the block mover over them, with the CPU pool for swaps."""
    # a self-draft's runner shares the target's cache list: each list is sized and filled once
    models = [(r, c) for j, (r, c) in enumerate(models) if all(r.kv_caches is not o.kv_caches for o, _ in models[:j])]
    shapes = [
        CacheShape(_layers_here(r, c), parallel.heads(c.num_heads, c.num_kv_heads).num_kv_heads, c.head_dim)
        for r, c in models
    ]
    dtype = kv_cache_dtype(config.kv_cache_dtype, model_dtype)  # FP8: 1 byte an element (FP8KVCache)
    num_blocks, num_cpu_blocks = plan_blocks(
        config, shapes, max_model_len, lookahead, dtype, device, agree=parallel.min
    )
    for (r, _), s in zip(models, shapes):  # one block more than the allocator owns: the null block
        scales = r.kv_scales
        if scales is not None and r.stages is not None:  # a pipeline stage's layers' own
            scales = scales[r.stages.stage.start : r.stages.stage.end]
        r.kv_caches.extend(allocate_kv_cache(s, num_blocks + 1, config.block_size, dtype, device, scales))
    block_mover = BlockMover(num_cpu_blocks)
    for r, _ in models:
        block_mover.add(r.kv_caches)
    return num_blocks, block_mover
