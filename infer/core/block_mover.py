"""Applying a step's KV block operations to the KV tensors, before the forward.

The allocator decides (copy-on-write, swap out, swap in); this moves the bytes. Each kind of
operation is one batched gather (`index_select`) and scatter (`index_copy_`) per KV tensor, in
the order swap-out, swap-in, copy: swap-outs read blocks that the step may hand out again, and
a batched copy reads all its sources before it writes any destination. The CPU pool mirrors every
registered cache (a draft model's too, when it shares the block tables) and is pinned when the
cache lives on a GPU, so swaps are DMA transfers. Copies are exact: swap out and in is bit-exact.
FP8 blocks move as their bytes (uint8 views: torch has no index_copy_ for float8 on the CPU), and an
FP8 cache's scales stay with the layer: they are static, the same for every block.
"""

from __future__ import annotations

import torch

from infer.api import BlockOps, KVCache


class BlockMover:
    def __init__(self, num_cpu_blocks: int = 0) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self.caches: list[KVCache] = []  # device (k, v) per layer, of every model sharing the block tables
        self.cpu_caches: list[KVCache] = []  # their CPU mirrors, [num_cpu_blocks, block_size, heads, dim]

    def add(self, caches: list[KVCache]) -> None:
        """Register the layer caches of one model (`kv_cache.build_kv_caches` does, once per model)."""
        for k, v in caches:
            self.caches.append((k, v))
            if self.num_cpu_blocks:
                pin = k.device.type == "cuda"
                shape = (self.num_cpu_blocks, *k.shape[1:])
                # empty: a CPU block is always written by a swap-out before a swap-in reads it
                k_cpu, v_cpu = (torch.empty(shape, dtype=t.dtype, pin_memory=pin) for t in (k, v))
                self.cpu_caches.append((k_cpu, v_cpu))

    def apply(self, ops: BlockOps) -> None:
        if not ops:
            return
        assert not (ops.swap_out and ops.swap_in), "a step never both swaps out and swaps in"
        if ops.swap_out:
            self._move(self.caches, self.cpu_caches, ops.swap_out)
        if ops.swap_in:
            self._move(self.cpu_caches, self.caches, ops.swap_in)
        if ops.copies:
            self._move(self.caches, self.caches, ops.copies)

    @staticmethod
    def _move(sources: list[KVCache], targets: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        # pairs: (source block, target block); each tensor [num_blocks, block_size, heads, dim]
        assert len(sources) == len(targets), "no CPU pool: --preemption-mode swap needs --swap-space > 0"
        if not sources:
            return
        src_device, dst_device = sources[0][0].device, targets[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
        non_blocking = dst_device.type == "cuda"  # a host copy must have landed before index_copy_ reads it
        for source, target in zip(sources, targets):
            for s, t in zip(source, target):
                if s.dtype == torch.float8_e4m3fn:
                    s, t = s.view(torch.uint8), t.view(torch.uint8)
                t.index_copy_(0, dst, s.index_select(0, src).to(dst_device, non_blocking=non_blocking))
