"""The FP8 KV cache's storage: the quantization rule, the budget at one byte an element, the per-layer
scales it is allocated with, and block copies and swaps of its bytes."""

from __future__ import annotations

import torch

from infer.api import BlockOps
from infer.api.config import EngineConfig
from infer.api.kv_cache import FP8, FP8KVCache, kv_scales, quantize_fp8
from infer.core.block_mover import BlockMover
from infer.runtime.kv_cache import CacheShape, allocate_kv_cache, plan_blocks

SHAPES = [CacheShape(num_layers=3, num_kv_heads=2, head_dim=16), CacheShape(num_layers=2, num_kv_heads=1, head_dim=8)]


def test_quantize_clamps_to_e4m3_and_rounds_to_nearest_even():
    # ties: 1.0625 between 1 and 1.125, 1.1875 between 1.125 and 1.25; below 2^-6, steps of 2^-9
    x = torch.tensor([1000.0, -1000.0, 448.0, 3.3, 1.0625, 1.1875, 2.0**-9, 3 * 2.0**-10, 2.0**-10])
    assert quantize_fp8(x, 1.0).float().tolist() == [448.0, -448.0, 448.0, 3.25, 1.0, 1.25, 2.0**-9, 2.0**-8, 0.0]
    # stored = x / scale: 0.5 -> 1000 is 2000 (clamped to 448), 3.3 is 6.6 (stored as 6.5)
    assert quantize_fp8(x[:4], 0.5).float().tolist() == [448.0, -448.0, 448.0, 6.5]


def _blocks(config: EngineConfig, dtype: torch.dtype) -> int:
    return plan_blocks(config, SHAPES, max_model_len=1024, lookahead=0, dtype=dtype, device=torch.device("cpu"))[0]


def test_the_budget_holds_twice_the_blocks_of_bf16():
    # bf16 bytes per block of 16 tokens: 2 (K, V) x 16 x (3 x 2 x 16 + 2 x 1 x 8) x 2 bytes = 7168
    config = EngineConfig(block_size=16, kv_cache_memory_gib=7168 * 1000 / 2**30)
    assert _blocks(config, torch.bfloat16) == 1000
    assert _blocks(config, FP8) == 2000 and _blocks(config, torch.float32) == 500
    swap = config.replace(preemption_mode="swap", swap_space_gib=7168 * 300 / 2**30)
    assert plan_blocks(swap, SHAPES, 1024, 0, FP8, torch.device("cpu"))[1] == 600  # the CPU pool too


def test_an_fp8_cache_is_a_scaled_tuple_per_layer():
    caches = allocate_kv_cache(SHAPES[0], 5, 4, FP8, torch.device("cpu"), scales=[(0.5, 2.0), (1.0, 1.0), (3.0, 0.25)])
    assert [kv_scales(c) for c in caches] == [(0.5, 2.0), (1.0, 1.0), (3.0, 0.25)]
    k, v = caches[0]  # unpacks as every layer cache does
    assert isinstance(caches[0], tuple) and k.dtype == v.dtype == FP8 and k.shape == (5, 4, 2, 16)
    assert all(kv_scales(c) == (1.0, 1.0) for c in allocate_kv_cache(SHAPES[1], 5, 4, FP8, torch.device("cpu")))
    plain = allocate_kv_cache(SHAPES[1], 5, 4, torch.float32, torch.device("cpu"))
    assert all(type(c) is tuple and kv_scales(c) == (1.0, 1.0) for c in plain)


def test_block_copies_and_swaps_move_fp8_bytes_exactly():
    gen = torch.Generator().manual_seed(0)
    caches = [
        FP8KVCache(*(torch.randint(0, 256, (6, 4, 2, 8), generator=gen, dtype=torch.uint8).view(FP8) for _ in "kv"))
        for _ in range(2)
    ]
    before = [[t.view(torch.uint8).clone() for t in layer] for layer in caches]
    mover = BlockMover(num_cpu_blocks=3)
    mover.add(caches)
    assert all(t.dtype == FP8 for layer in mover.cpu_caches for t in layer)
    mover.apply(BlockOps(swap_out=[(1, 0), (4, 2)]))
    for layer in caches:
        for t in layer:
            t.view(torch.uint8)[[1, 4]] = 0  # the blocks go to other requests
    mover.apply(BlockOps(swap_in=[(0, 5), (2, 1)], copies=[(3, 0)]))
    for layer, saved in zip(caches, before):
        for t, b in zip(layer, saved):
            got = t.view(torch.uint8)
            assert torch.equal(got[5], b[1]) and torch.equal(got[1], b[4]) and torch.equal(got[0], b[3])
    assert [kv_scales(c) for c in caches] == [(1.0, 1.0)] * 2
