"""The CPU side of preemption by swap: a pool of CPU KV blocks and the tables of swapped-out requests.

The bytes move in the engine (`infer.core.block_mover`), batched per step; this only keeps
account. The CPU blocks of a request swapped back in are freed when the step's block operations
are drained, after the copy that reads them has been handed to the engine.
"""

from __future__ import annotations

from infer.plugins.kv_allocator.block_pool import BlockPool


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}  # request id -> its CPU blocks, logical order
        self.releasing: list[int] = []  # read by this step's swap-ins: freed when the step's ops are drained

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free()

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables

    def store(self, request_id: str, num_blocks: int) -> list[int] | None:
        """CPU blocks for a request being swapped out, or None when the pool is too full."""
        assert request_id not in self.tables, f"{request_id} is swapped out already"
        ids = self.pool.take(num_blocks)
        if ids is not None:
            self.tables[request_id] = ids
        return ids

    def load(self, request_id: str) -> list[int]:
        """A request coming back: its CPU blocks, freed once this step's copies are on their way."""
        ids = self.tables.pop(request_id)
        self.releasing.extend(ids)
        return ids

    def drop(self, request_id: str) -> None:
        """A swapped-out request ended (aborted): its CPU copy is not needed."""
        self.pool.release(self.tables.pop(request_id))

    def flush(self) -> None:
        self.pool.release(self.releasing)
        self.releasing = []
