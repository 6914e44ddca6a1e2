"""Property tests for the KV block allocators (`paged`, `contiguous`) and their BlockPool.

A hypothesis state machine allocates, grows, frees and preempts requests the way the engine does,
and checks after every step that no block leaks, no block has two owners, reference counts match
the block tables, the free list holds each free block once, a refused `allocate_slots` changed
nothing, and `usage()` agrees with all of it. This machine never shares a block (no prefix
caching, no forks): `test_kv_sharing_properties` extends it with prefix caching, forks, beam
reassignment, copy-on-write and swap, over a real KV tensor.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infer.api import KVUsage
from infer.api.request import Request, SamplingParams
from infer.plugins.kv_allocator.block_pool import BlockPool
from infer.plugins.kv_allocator.contiguous import ContiguousAllocator
from infer.plugins.kv_allocator.paged import PagedAllocator

ALLOCATORS = [PagedAllocator, ContiguousAllocator]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(i: int, prompt_len: int, max_tokens: int = 16, max_model_len: int = 0) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=[1] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        arrival=i,
        max_model_len=max_model_len,
    )


def snapshot(alloc: PagedAllocator, requests) -> tuple:
    return (
        list(alloc.pool.free_ids),
        list(alloc.pool.ref_counts),
        {rid: r for rid, r in alloc.owners.items()},
        {r.request_id: (list(r.block_ids), r.num_computed_tokens) for r in requests},
    )


def check_pool(alloc: PagedAllocator, holders) -> None:
    """The module's invariant: every block is free exactly once, or owned by as many tables as its refcount."""
    pool = alloc.pool
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), f"duplicate on the free list: {free}"
    assert all(0 <= b < alloc.num_blocks for b in free)
    held: dict[int, int] = {}
    for r in holders:
        assert len(r.block_ids) == len(set(r.block_ids)), f"{r.request_id} holds a block twice: {r.block_ids}"
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    shared = {b: n for b, n in held.items() if n > 1}
    assert not shared, f"blocks owned by more than one table (nothing here shares): {shared}"
    assert not set(free) & set(held), f"blocks both free and owned: {sorted(set(free) & set(held))}"
    assert len(free) + len(held) == alloc.num_blocks, (
        f"leak: {len(free)} free + {len(held)} owned != {alloc.num_blocks}"
    )
    for b in range(alloc.num_blocks):
        assert pool.ref_counts[b] == held.get(b, 0), (
            f"block {b}: refcount {pool.ref_counts[b]} but {held.get(b, 0)} tables"
        )
    assert alloc.num_free_blocks() == len(free)


class AllocatorMachine(RuleBasedStateMachine):
    allocator_cls: type = PagedAllocator

    def __init__(self) -> None:
        super().__init__()
        self.alloc: PagedAllocator | None = None
        self.live: dict[str, Request] = {}  # holding blocks
        self.preempted: dict[str, Request] = {}  # freed, waiting to be recomputed
        self.tokens: dict[str, int] = {}  # tokens so far (prompt + output), tracked here
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4, 8]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.alloc = self.allocator_cls(num_blocks, block_size)
        self.capacity = num_blocks * block_size

    # ------------------------------------------------------------------ helpers

    def _pick(self, pool: dict[str, Request], i: int) -> Request:
        return pool[sorted(pool)[i % len(pool)]]

    def _expected_blocks(self, r: Request) -> int:
        tokens = self.tokens[r.request_id]
        if self.allocator_cls is ContiguousAllocator:
            tokens = max(tokens, ContiguousAllocator.max_len(r))
        return cdiv(tokens, self.alloc.block_size)

    def _try(self, r: Request, num_tokens: int) -> list[int] | None:
        """allocate_slots, checking that a refusal changed nothing and a grant matches the table."""
        everyone = [*self.live.values(), *self.preempted.values(), r]
        before = snapshot(self.alloc, everyone)
        old_table = list(r.block_ids)
        got = self.alloc.allocate_slots(r, num_tokens)
        if got is None:
            assert snapshot(self.alloc, everyone) == before, "a refused allocate_slots changed state"
            # refused only when the free list really is too short
            want = num_tokens
            if self.allocator_cls is ContiguousAllocator and not old_table:
                want = max(want, ContiguousAllocator.max_len(r))
            assert self.alloc.blocks_needed(r, want) > self.alloc.num_free_blocks()
            return None
        assert r.block_ids == old_table + got, "granted ids must be appended to the block table"
        assert self.alloc.owners.get(r.request_id) is r
        return got

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: self.alloc is not None)
    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 24), mml_extra=st.none() | st.integers(1, 30))
    def allocate(self, prompt_len: int, max_tokens: int, mml_extra: int | None) -> None:
        mml = 0 if mml_extra is None else prompt_len + mml_extra
        r = make_request(self.next_id, prompt_len, max_tokens, mml)
        self.next_id += 1
        if self._try(r, prompt_len) is None:
            assert r.block_ids == [] and r.request_id not in self.alloc.owners
            return
        self.live[r.request_id] = r
        self.tokens[r.request_id] = prompt_len
        r.num_computed_tokens = prompt_len  # prefill wrote the prompt's K/V

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000), k=st.integers(1, 16))
    def append(self, i: int, k: int) -> None:
        r = self._pick(self.live, i)
        k = min(k, 2 * self.alloc.block_size)
        total = self.tokens[r.request_id] + k
        if self._try(r, total) is None:
            return
        self.tokens[r.request_id] = total
        r.num_computed_tokens = total

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000))
    def free(self, i: int) -> None:
        r = self._pick(self.live, i)
        n_free, n_held = self.alloc.num_free_blocks(), len(r.block_ids)
        self.alloc.free(r)
        assert r.block_ids == [] and r.request_id not in self.alloc.owners
        assert self.alloc.num_free_blocks() == n_free + n_held
        del self.live[r.request_id]

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000))
    def preempt(self, i: int) -> None:
        r = self._pick(self.live, i)
        n_free, n_held = self.alloc.num_free_blocks(), len(r.block_ids)
        self.alloc.free(r)
        r.num_computed_tokens = 0  # as FcfsScheduler._preempt: recompute from scratch
        assert r.block_ids == [] and self.alloc.num_free_blocks() == n_free + n_held
        del self.live[r.request_id]
        self.preempted[r.request_id] = r

    @precondition(lambda self: self.alloc is not None and self.preempted)
    @rule(i=st.integers(0, 1000))
    def resume(self, i: int) -> None:
        r = self._pick(self.preempted, i)
        if self._try(r, self.tokens[r.request_id]) is None:
            return
        del self.preempted[r.request_id]
        self.live[r.request_id] = r
        r.num_computed_tokens = self.tokens[r.request_id]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def blocks_accounted(self) -> None:
        if self.alloc is None:
            return
        check_pool(self.alloc, [*self.live.values(), *self.preempted.values()])
        assert all(r.block_ids == [] for r in self.preempted.values())

    @invariant()
    def tables_sized(self) -> None:
        if self.alloc is None:
            return
        for r in self.live.values():
            assert len(r.block_ids) == self._expected_blocks(r), (r.request_id, self.tokens[r.request_id], r.block_ids)
            assert len(r.block_ids) * self.alloc.block_size >= r.num_computed_tokens

    @invariant()
    def owners_match(self) -> None:
        if self.alloc is None:
            return
        assert set(self.alloc.owners) == set(self.live)
        assert all(self.alloc.owners[rid] is r for rid, r in self.live.items())

    @invariant()
    def usage_consistent(self) -> None:
        if self.alloc is None:
            return
        u = self.alloc.usage()
        used = self.alloc.num_blocks - self.alloc.num_free_blocks()
        assert isinstance(u, KVUsage)
        assert u.num_blocks == self.alloc.num_blocks
        assert u.num_used_blocks == used == sum(len(r.block_ids) for r in self.live.values())
        assert u.num_reserved_slots == used * self.alloc.block_size
        assert u.num_filled_slots == sum(r.num_computed_tokens for r in self.live.values())
        assert 0 <= u.num_filled_slots <= u.num_reserved_slots


class ContiguousMachine(AllocatorMachine):
    allocator_cls = ContiguousAllocator


MACHINE_SETTINGS = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPagedAllocatorMachine = AllocatorMachine.TestCase
TestPagedAllocatorMachine.settings = MACHINE_SETTINGS
TestContiguousAllocatorMachine = ContiguousMachine.TestCase
TestContiguousAllocatorMachine.settings = MACHINE_SETTINGS


# --------------------------------------------------------------------------- plain tests


def test_pool_double_free_trips_assert():
    pool = BlockPool(4)
    ids = pool.take(2)
    pool.release(ids)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(ids)


def test_pool_release_of_never_taken_block_trips_assert():
    with pytest.raises(AssertionError, match="double free"):
        BlockPool(3).release([1])


def test_pool_share_of_free_block_trips_assert():
    with pytest.raises(AssertionError, match="sharing free block"):
        BlockPool(3).share([0])


def test_pool_take_too_many_changes_nothing():
    pool = BlockPool(3)
    pool.take(2)
    before = (list(pool.free_ids), list(pool.ref_counts))
    assert pool.take(2) is None
    assert (list(pool.free_ids), list(pool.ref_counts)) == before
    assert pool.take(0) == []


def test_pool_shared_block_freed_after_last_reference():
    pool = BlockPool(2)
    ids = pool.take(1)
    pool.share(ids)
    pool.release(ids)
    assert ids[0] not in pool.free_ids and pool.ref_counts[ids[0]] == 1
    pool.release(ids)
    assert list(pool.free_ids).count(ids[0]) == 1 and pool.ref_counts[ids[0]] == 0


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_allocator_double_free_of_stale_table_trips_assert(cls):
    alloc = cls(4, 4)
    r = make_request(0, 6, max_tokens=2)
    assert alloc.allocate_slots(r, 6)
    stale = list(r.block_ids)
    alloc.free(r)
    r.block_ids = stale  # a table that was already given back
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(r)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_allocator_free_twice_is_harmless(cls):
    """free() empties the table, so freeing the same request again (abort after finish) is a no-op."""
    alloc = cls(4, 4)
    r = make_request(0, 6, max_tokens=2)
    alloc.allocate_slots(r, 6)
    alloc.free(r)
    alloc.free(r)
    check_pool(alloc, [r])
    assert alloc.num_free_blocks() == 4


@pytest.mark.parametrize("cls", ALLOCATORS)
@pytest.mark.parametrize("num_blocks,block_size", [(1, 1), (1, 16), (3, 4), (7, 8)])
def test_can_ever_fit_boundaries(cls, num_blocks, block_size):
    alloc = cls(num_blocks, block_size)
    cap = num_blocks * block_size
    assert alloc.can_ever_fit(0)
    assert alloc.can_ever_fit(1)
    assert alloc.can_ever_fit(cap - 1)
    assert alloc.can_ever_fit(cap)
    assert not alloc.can_ever_fit(cap + 1)
    assert not alloc.can_ever_fit(cap + block_size)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4, 8, 16]), n=st.integers(1, 200))
def test_paged_can_ever_fit_iff_empty_pool_grants(num_blocks, block_size, n):
    alloc = PagedAllocator(num_blocks, block_size)
    fits = alloc.can_ever_fit(n)
    assert fits == (alloc.allocate_slots(make_request(0, n), n) is not None)
    assert fits == (n <= num_blocks * block_size)


@pytest.mark.parametrize(
    "prompt,max_tokens,max_model_len,reserved",
    [
        (5, 10, 0, 15),  # no context limit: prompt + max_tokens
        (5, 10, 12, 12),  # the context limit is shorter
        (5, 10, 100, 15),  # the context limit is longer
        (5, 10, 15, 15),
        (1, 1, 0, 2),
    ],
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_contiguous_reserves_max_length_up_front(prompt, max_tokens, max_model_len, reserved, block_size):
    alloc = ContiguousAllocator(64, block_size)
    r = make_request(0, prompt, max_tokens, max_model_len)
    assert ContiguousAllocator.max_len(r) == reserved
    got = alloc.allocate_slots(r, prompt)
    assert got is not None and len(r.block_ids) == cdiv(reserved, block_size)
    # growing within the reservation takes nothing new
    for n in range(prompt, reserved + 1):
        assert alloc.allocate_slots(r, n) == []
    assert len(r.block_ids) == cdiv(reserved, block_size)
    # beyond it (the engine never asks, but the allocator must still be exact) it grows like paged
    more = alloc.allocate_slots(r, cdiv(reserved, block_size) * block_size + 1)
    assert more is not None and len(more) == 1
    check_pool(alloc, [r])


def test_contiguous_rereserves_after_preemption():
    alloc = ContiguousAllocator(8, 4)
    r = make_request(0, 3, max_tokens=10)  # max_len 13 -> 4 blocks
    alloc.allocate_slots(r, 3)
    assert len(r.block_ids) == 4
    alloc.free(r)
    r.num_computed_tokens = 0
    r.output_token_ids = [9, 9]
    alloc.allocate_slots(r, r.num_tokens)
    assert len(r.block_ids) == 4


def test_contiguous_refuses_when_max_length_cannot_fit_even_if_prompt_does():
    """Documented behaviour the schedulers must cope with: can_ever_fit(prompt + 1) is true,
    yet the up-front reservation (prompt + max_tokens) is refused on an empty pool."""
    alloc = ContiguousAllocator(2, 4)  # 8 slots
    r = make_request(0, 4, max_tokens=10)  # reserves 14
    assert alloc.can_ever_fit(r.num_tokens + 1)
    assert alloc.allocate_slots(r, r.num_tokens) is None
    assert alloc.num_free_blocks() == 2 and r.block_ids == []


def test_paged_grants_only_the_missing_blocks():
    alloc = PagedAllocator(10, 4)
    r = make_request(0, 5)
    assert len(alloc.allocate_slots(r, 5)) == 2
    assert alloc.allocate_slots(r, 8) == []
    assert len(alloc.allocate_slots(r, 9)) == 1
    assert alloc.allocate_slots(r, 3) == []  # asking for fewer never shrinks the table
    assert len(r.block_ids) == 3
