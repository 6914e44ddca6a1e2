"""Reference-counted KV blocks, with least-recently-used eviction of cached ones.

Invariant: every block is either owned (refcount = number of block tables holding it) or free
exactly once, on one of two lists: `free_ids` when it holds nothing worth keeping, `evictable`
when the prefix cache still maps it. Taking blocks drains `free_ids` first; only when it runs dry
are cached blocks evicted, least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from infer.plugins.kv_allocator.prefix_cache import PrefixCache


class BlockPool:
    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.cache = cache
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recent first
        self.ref_counts = [0] * num_blocks

    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def free_block_ids(self) -> list[int]:
        return [*self.free_ids, *self.evictable]

    def take(self, n: int) -> list[int] | None:
        if n > self.num_free():
            return None
        ids = []
        for _ in range(n):
            if self.free_ids:
                block = self.free_ids.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                assert self.cache is not None, "only blocks the prefix cache maps are evictable"
                self.cache.forget(block)
            assert self.ref_counts[block] == 0, f"block {block} handed out while owned"
            self.ref_counts[block] = 1
            ids.append(block)
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            assert self.ref_counts[i] > 0, f"sharing free block {i}"
            self.ref_counts[i] += 1

    def touch(self, ids: list[int]) -> None:
        """Take a reference on cached blocks a lookup found, reviving unreferenced ones."""
        for i in ids:
            if self.ref_counts[i] == 0:
                del self.evictable[i]
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> list[int]:
        """Drop one reference to each block; returns the blocks that became free."""
        freed = []
        for i in reversed(ids):  # tail blocks go back first and are reused first; a prefix's head stays longest
            assert self.ref_counts[i] > 0, f"double free of block {i}"
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                freed.append(i)
                if self.cache is not None and self.cache.is_cached(i):
                    self.evictable[i] = None
                else:
                    self.free_ids.append(i)
        return freed
