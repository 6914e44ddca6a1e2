"""KV block allocators: `paged` (blocks on demand) and `contiguous` (max length reserved up front).

Both own a free list and reference counts over `num_blocks` physical blocks, and write each
request's block table into `request.block_ids`. Invariant: every block is either free (refcount 0,
on the free list exactly once) or owned (refcount = number of block tables holding it).
"""

from __future__ import annotations

from collections import deque

from infer.core.hookspecs import hookimpl
from infer.core.interfaces import Capabilities, KVUsage
from infer.core.request import Request


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            assert self.ref_counts[i] == 0, f"block {i} handed out while owned"
            self.ref_counts[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            assert self.ref_counts[i] > 0, f"sharing free block {i}"
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> None:
        for i in reversed(ids):  # tail blocks go back first and are reused first; a prefix's head stays longest
            assert self.ref_counts[i] > 0, f"double free of block {i}"
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)


class PagedAllocator:
    """Blocks are granted as a request grows: waste is at most one partly filled block per request."""

    capabilities = Capabilities()

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self.owners: dict[str, Request] = {}

    def num_free_blocks(self) -> int:
        return len(self.pool.free_ids)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        new_ids = self.pool.take(self.blocks_needed(request, num_tokens))
        if new_ids is None:
            return None
        request.block_ids.extend(new_ids)
        self.owners[request.request_id] = request
        return new_ids

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids)
        request.block_ids = []
        self.owners.pop(request.request_id, None)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def can_ever_run(self, request: Request, num_tokens: int) -> bool:
        return self.can_ever_fit(num_tokens)

    def usage(self) -> KVUsage:
        used = self.num_blocks - len(self.pool.free_ids)
        filled = sum(r.num_computed_tokens for r in self.owners.values())
        return KVUsage(self.num_blocks, used, used * self.block_size, filled)


class ContiguousAllocator(PagedAllocator):
    """The pre-paging way: a request's whole maximum length is reserved at its first allocation."""

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        if not request.block_ids:
            num_tokens = max(num_tokens, self.max_len(request))
        return super().allocate_slots(request, num_tokens)

    def can_ever_run(self, request: Request, num_tokens: int) -> bool:
        return self.can_ever_fit(max(num_tokens, self.max_len(request)))

    @staticmethod
    def max_len(request: Request) -> int:
        limit = request.num_prompt_tokens + request.params.max_tokens
        return min(limit, request.max_model_len) if request.max_model_len else limit


@hookimpl
def infer_register_kv_allocators(register) -> None:
    register("paged", PagedAllocator)
    register("contiguous", ContiguousAllocator)
