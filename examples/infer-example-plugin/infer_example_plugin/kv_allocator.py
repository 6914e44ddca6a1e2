"""`example-refcount`: KV blocks on demand from a free list, reference counted.

A request's table grows block by block as it needs them. `fork` (parallel samples) and `reassign`
(beams) share blocks by counting their owners; the first write into a block that another table
holds copies it first (copy-on-write: the copy is recorded in `BlockOps` for the engine to make
before the step's forward). It keeps no prefix cache (a request never starts from cached blocks,
whatever `enable_prefix_caching` says) and no CPU swap space (`swap_out` declines, so a preempted
request is recomputed). `pytest --infer-kit kv_allocator=example-refcount` checks it.
"""

from __future__ import annotations

import infer
from infer.api import BlockOps, KVUsage
from infer.api.request import Request

INFER_PLUGIN_API = ">=2,<3"  # API 2: the factory takes num_cpu_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefCountAllocator:
    capabilities = infer.Capabilities()

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks  # block -> tables holding it
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id first
        self.owners: dict[str, Request] = {}  # requests holding blocks (for usage())
        self.ops = BlockOps()  # copies recorded since the last take_block_ops
        self.copied_from: dict[int, int] = {}  # dst -> src of those copies (not made yet)

    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        table, bs = request.block_ids, self.block_size
        written = range(request.num_computed_tokens // bs, min(len(table), cdiv(num_tokens, bs)))
        shared = [i for i in written if self.refs[table[i]] > 1]  # to copy before they are written
        grow = max(0, cdiv(num_tokens, bs) - len(table))
        if len(shared) + grow > len(self.free_ids):
            return None  # and nothing changed
        new = [self.free_ids.pop() for _ in range(len(shared) + grow)]
        for block in new:
            self.refs[block] = 1
        for i, dst in zip(shared, new):
            src = self.copied_from.get(table[i], table[i])  # a copy not made yet: its content is still at src
            self.ops.copies.append((src, dst))
            self.copied_from[dst] = src
            self._release([table[i]])
            table[i] = dst
        table.extend(new[len(shared) :])
        self.owners[request.request_id] = request
        return new[len(shared) :]

    def num_cached_tokens(self, request: Request) -> int:
        return 0  # no prefix cache

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        child.block_ids = parent.block_ids[: cdiv(num_tokens, self.block_size)]
        for block in child.block_ids:
            self.refs[block] += 1
        child.num_computed_tokens = num_tokens
        self.owners[child.request_id] = child

    def reassign(self, pairs: list[tuple[Request, Request]]) -> None:
        tables = {src.request_id: list(src.block_ids) for _, src in pairs}  # as they were before the call
        for dst, src in pairs:
            for block in tables[src.request_id]:
                self.refs[block] += 1
            self._release(dst.block_ids)
            dst.block_ids = list(tables[src.request_id])
            self.owners[dst.request_id] = dst

    def free(self, request: Request) -> None:
        self._release(request.block_ids)
        request.block_ids = []
        self.owners.pop(request.request_id, None)

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_ids.append(block)
                if block in self.copied_from:  # a copy into a block nobody holds any more: not made
                    self.ops.copies.remove((self.copied_from.pop(block), block))

    def swap_out(self, request: Request) -> bool:
        return False  # no CPU swap space: the scheduler recomputes the request instead

    def is_swapped(self, request: Request) -> bool:
        return False

    def take_block_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        self.copied_from.clear()
        return ops

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def can_ever_run(self, request: Request, num_tokens: int) -> bool:
        return self.can_ever_fit(num_tokens)

    def usage(self) -> KVUsage:
        used, bs = self.num_blocks - len(self.free_ids), self.block_size
        filled: dict[int, int] = {}  # block -> its slots holding a computed token (a shared block once)
        for r in self.owners.values():
            n = min(r.num_computed_tokens, len(r.block_ids) * bs)
            for j, block in enumerate(r.block_ids[: cdiv(n, bs)]):
                filled[block] = max(filled.get(block, 0), min(bs, n - j * bs))
        entries = sum(len(r.block_ids) for r in self.owners.values())
        return KVUsage(self.num_blocks, used, used * bs, sum(filled.values()), num_saved_blocks=entries - used)


@infer.hookimpl
def infer_register_kv_allocators(register) -> None:
    register("example-refcount", RefCountAllocator)
