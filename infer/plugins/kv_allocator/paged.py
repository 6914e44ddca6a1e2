"""The `paged` KV block allocator: blocks on demand (`contiguous` reserves the max length up front).

It owns a BlockPool of `num_blocks` reference-counted blocks and write each request's block table
into `request.block_ids`. Invariant: every block is either free (refcount 0, on one free list
exactly once) or owned (refcount = number of block tables holding it).

Sharing. A table may share blocks with others: parallel samples and beams `fork` (refcount + 1),
and with prefix caching a new request adopts the cached blocks of its longest cached prefix. A
shared block is never written: the first write into a block that is shared, or cached, copies it
first (copy-on-write) into a fresh block. The allocator only records the copy; the step's copies
are drained with `take_block_ops` and applied by the engine in one batched copy before the forward.

Prefix caching. A full block is registered under its `BlockKey` once all its tokens are computed
(lazily: at the request's next allocation, swap-out or free). Registered blocks outlive their
requests and are evicted least recently used first (see BlockPool).

Swap. `swap_out` moves a preempted request's blocks into the CPU pool (the copies are recorded
like copy-on-write); its next `allocate_slots` brings them back into fresh device blocks.
"""

from __future__ import annotations

from infer.api import BlockOps, Capabilities, KVUsage
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.kv_allocator.block_pool import BlockPool
from infer.plugins.kv_allocator.prefix_cache import BlockKey, PrefixCache, root_key
from infer.plugins.kv_allocator.swap import SwapSpace

__all__ = ["BlockPool", "PagedAllocator"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedAllocator:
    """Blocks are granted as a request grows: waste is at most one partly filled block per request."""

    capabilities = Capabilities()

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.cache)
        self.swap = SwapSpace(num_cpu_blocks)
        self.owners: dict[str, Request] = {}  # requests holding device blocks
        self.keys: dict[str, list[BlockKey]] = {}  # request -> keys of its leading full, computed blocks
        self.ops = BlockOps()  # recorded since the last take_block_ops
        self.copy_src: dict[int, int] = {}  # pending copy-on-write: dst -> src

    def num_free_blocks(self) -> int:
        return self.pool.num_free()

    def is_swapped(self, request: Request) -> bool:
        return self.swap.holds(request.request_id)

    # ------------------------------------------------------------------ growth

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks `allocate_slots(request, num_tokens)` takes off the free lists."""
        want = cdiv(num_tokens, self.block_size)
        if self.is_swapped(request):
            return max(want, len(self.swap.tables[request.request_id]))
        if not request.block_ids and request.num_computed_tokens == 0 and self.cache is not None:
            hits, _ = self._lookup(self.cache, request, num_tokens)
            return max(0, want - len(hits)) + sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        return max(0, want - len(request.block_ids)) + len(self._blocks_to_copy(request, num_tokens))

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        """Grow the table to hold `num_tokens`; returns the ids appended, or None (and changes nothing).

        On an empty table with prefix caching, the longest cached prefix (never the last token)
        is adopted first and `request.num_computed_tokens` moves past it. Blocks about to be
        written that are shared or cached are replaced by copies. A swapped-out request's
        blocks come back first.
        """
        if self.is_swapped(request):
            return self._swap_in(request, num_tokens)
        table = request.block_ids
        if not table and request.num_computed_tokens == 0 and (cache := self._cache_for(request)) is not None:
            return self._allocate_with_prefix(cache, request, num_tokens)
        self._register_full_blocks(request)
        to_copy = self._blocks_to_copy(request, num_tokens)
        grow = max(0, cdiv(num_tokens, self.block_size) - len(table))
        if not to_copy and not grow:  # most decode steps: the next token fits a block of its own
            self.owners[request.request_id] = request
            return []
        new = self.pool.take(len(to_copy) + grow)
        if new is None:
            return None
        for i, dst in zip(to_copy, new):
            src = self.copy_src.get(table[i], table[i])  # a pending copy's content is still at its source
            self.ops.copies.append((src, dst))
            self.copy_src[dst] = src
            self._release([table[i]])  # still held by its other owners or by the cache
            table[i] = dst
        table.extend(new[len(to_copy) :])
        self.owners[request.request_id] = request
        return new[len(to_copy) :]

    def num_cached_tokens(self, request: Request) -> int:
        """Tokens `allocate_slots` would find cached for this request (0 unless its table is empty)."""
        cache = self._cache_for(request)
        if request.block_ids or request.num_computed_tokens or cache is None or self.is_swapped(request):
            return 0
        return len(self._lookup(cache, request, request.num_tokens)[0]) * self.block_size

    def _cache_for(self, request: Request) -> PrefixCache | None:
        """The prefix cache, where it may serve `request`'s prompt; else None."""
        # a cached prefix has no logits to score nor hidden states to pool: a request asking for prompt
        # logprobs or an embedding computes its whole prompt (as vLLM does); its blocks are still cached for
        # the requests after it
        return None if request.computes_whole_prompt else self.cache

    def _lookup(self, cache: PrefixCache, request: Request, num_tokens: int) -> tuple[list[int], list[BlockKey]]:
        max_blocks = min(request.num_tokens - 1, num_tokens) // self.block_size  # keep a token to compute
        return cache.lookup(request.all_token_ids, self.block_size, max_blocks, root_key(request.prefix_key))

    def _allocate_with_prefix(self, cache: PrefixCache, request: Request, num_tokens: int) -> list[int] | None:
        hits, keys = self._lookup(cache, request, num_tokens)
        revive = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        grow = max(0, cdiv(num_tokens, self.block_size) - len(hits))
        if grow + revive > self.pool.num_free():
            return None
        self.pool.touch(hits)
        new = self.pool.take(grow)
        assert new is not None
        request.block_ids = hits + new
        request.num_computed_tokens = len(hits) * self.block_size
        self.keys[request.request_id] = keys
        self.owners[request.request_id] = request
        cache.record(request.num_tokens, len(hits) * self.block_size)
        return hits + new

    def _blocks_to_copy(self, request: Request, num_tokens: int) -> list[int]:
        """Logical indices of blocks that the next writes (tokens computed..num_tokens) must not touch in place."""
        table, start = request.block_ids, request.num_computed_tokens // self.block_size
        stop = min(len(table), cdiv(num_tokens, self.block_size))
        refs = self.pool.ref_counts
        if self.cache is None:
            return [i for i in range(start, stop) if refs[table[i]] > 1]
        cached = self.cache.is_cached
        return [i for i in range(start, stop) if refs[table[i]] > 1 or cached(table[i])]

    def _register_full_blocks(self, request: Request) -> None:
        if self.cache is None or not request.block_ids:
            return
        keys = self.keys.get(request.request_id)
        if keys is not None and request.num_computed_tokens // self.block_size <= len(keys):
            return  # no block filled since the last call (num_full below is at most this)
        keys = self.keys.setdefault(request.request_id, [])
        num_full = (
            min(request.num_computed_tokens, request.num_tokens, len(request.block_ids) * self.block_size)
            // self.block_size
        )
        if num_full <= len(keys):
            return
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(len(keys), num_full):
            key = BlockKey(keys[-1] if keys else root_key(request.prefix_key), tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(self.cache.register(request.block_ids[i], key))

    # ------------------------------------------------------------------ sharing

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """`child` (holding nothing) shares the blocks of `parent`'s first `num_tokens` computed tokens."""
        assert not child.block_ids and not self.is_swapped(child), f"{child.request_id} already holds blocks"
        assert num_tokens <= parent.num_computed_tokens, "fork past what the parent has computed"
        ids = parent.block_ids[: cdiv(num_tokens, self.block_size)]
        self.pool.share(ids)
        child.block_ids = list(ids)
        child.num_computed_tokens = num_tokens
        if self.cache is not None:
            self.keys[child.request_id] = self.keys.get(parent.request_id, [])[: num_tokens // self.block_size]
        if ids:
            self.owners[child.request_id] = child

    def reassign(self, pairs: list[tuple[Request, Request]]) -> None:
        """For each (dst, src): dst's table becomes a share of src's table as it was before the call."""
        tables = {src.request_id: list(src.block_ids) for _, src in pairs}
        keys = {src.request_id: list(self.keys.get(src.request_id, [])) for _, src in pairs}
        for _, src in pairs:
            self.pool.share(tables[src.request_id])
        for dst, src in pairs:
            self._release(dst.block_ids)
            dst.block_ids = list(tables[src.request_id])
            self.keys[dst.request_id] = list(keys[src.request_id])
            if dst.block_ids:
                self.owners[dst.request_id] = dst
            else:
                self.owners.pop(dst.request_id, None)

    # ------------------------------------------------------------------ freeing and swapping

    def free(self, request: Request) -> None:
        if self.is_swapped(request):
            self.swap.drop(request.request_id)
        self._register_full_blocks(request)  # what it computed stays findable
        self._release(request.block_ids)
        request.block_ids = []
        self.owners.pop(request.request_id, None)
        self.keys.pop(request.request_id, None)

    def swap_out(self, request: Request) -> bool:
        """Move a request's blocks to the CPU pool; False (nothing changed) when the pool is too full."""
        cpu = self.swap.store(request.request_id, len(request.block_ids))
        if cpu is None:
            return False
        self._register_full_blocks(request)
        self.ops.swap_out.extend((self.copy_src.get(b, b), c) for b, c in zip(request.block_ids, cpu))
        self._release(request.block_ids)
        request.block_ids = []
        self.owners.pop(request.request_id, None)
        self.keys.pop(request.request_id, None)
        return True

    def _swap_in(self, request: Request, num_tokens: int) -> list[int] | None:
        cpu = self.swap.tables[request.request_id]
        new = self.pool.take(max(len(cpu), cdiv(num_tokens, self.block_size)))
        if new is None:
            return None
        self.ops.swap_in.extend(zip(self.swap.load(request.request_id), new))
        request.block_ids = new
        self.owners[request.request_id] = request
        return new

    def _release(self, ids: list[int]) -> None:
        for block in self.pool.release(ids):
            if block in self.copy_src:  # a copy into a block nobody holds any more: drop it
                src = self.copy_src.pop(block)
                self.ops.copies.remove((src, block))

    def take_block_ops(self) -> BlockOps:
        """The copies recorded since the last call, for the engine to apply before the next forward."""
        ops, self.ops = self.ops, BlockOps()
        self.copy_src.clear()
        self.swap.flush()
        return ops

    # ------------------------------------------------------------------ limits and reporting

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def can_ever_run(self, request: Request, num_tokens: int) -> bool:
        return self.can_ever_fit(num_tokens)

    def reset_stats(self) -> None:
        """The prefix cache's lookup and hit counts start again (`Engine.reset_stats`)."""
        if self.cache is not None:
            self.cache.num_query_tokens = self.cache.num_hit_tokens = 0

    def usage(self) -> KVUsage:
        used = self.num_blocks - self.pool.num_free()
        bs = self.block_size
        filled: dict[int, int] = {}  # physical block -> slots holding a computed token (max over its tables)
        entries = 0
        for r in self.owners.values():
            table = r.block_ids
            entries += len(table)
            n = min(r.num_computed_tokens, len(table) * bs)
            for b in table[: n // bs]:
                filled[b] = bs
            if n % bs:
                b = table[n // bs]
                filled[b] = max(filled.get(b, 0), n % bs)
        cache = self.cache
        return KVUsage(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_reserved_slots=used * bs,
            num_filled_slots=sum(filled.values()),
            num_saved_blocks=entries - used,
            num_cached_blocks=len(cache) if cache is not None else 0,
            prefix_query_tokens=cache.num_query_tokens if cache is not None else 0,
            prefix_hit_tokens=cache.num_hit_tokens if cache is not None else 0,
            num_swapped_blocks=self.swap.num_used_blocks,
        )


@hookimpl
def infer_register_kv_allocators(register) -> None:
    register("paged", PagedAllocator)
