"""KV allocator invariants through the `KVAllocator` protocol only, as a hypothesis state machine.

Requests are allocated, grown, freed, preempted and resumed the way a scheduler does (with and
without prefix caching; no two prompts share a prefix, and nothing forks or swaps); after every
step: no block leaks (free + owned = all), no block has two owners (no request here shares a
prefix or forks), every table covers its tokens, a refused `allocate_slots` changed nothing, and
`usage()` agrees.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from infer.api.request import Request, SamplingParams

MACHINE_SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _state(alloc: Any, requests: list[Request]) -> tuple:
    return alloc.num_free_blocks(), {r.request_id: (list(r.block_ids), r.num_computed_tokens) for r in requests}


class AllocatorRules(RuleBasedStateMachine):
    """The rules and invariants, for a subclass that adds the `initialize` rule building the
    allocator under test (`allocator_machine`)."""

    kv_allocator = ""  # the strategy's name, for messages

    def __init__(self) -> None:
        super().__init__()
        self.alloc: Any = None
        self.live: dict[str, Request] = {}  # holding blocks
        self.preempted: dict[str, Request] = {}  # freed, to be recomputed
        self.tokens: dict[str, int] = {}  # tokens so far, tracked here
        self.rng = random.Random(0)
        self.log: list[str] = []  # the calls so far, for messages

    def fail(self, what: str) -> AssertionError:
        calls = "; ".join(self.log[-6:])
        return AssertionError(
            f"kv_allocator {self.kv_allocator} ({self.alloc.num_blocks} blocks of {self.alloc.block_size} "
            f"tokens): {what} [last calls: {calls}]"
        )

    def build(self, factory: Any, num_blocks: int, block_size: int, caching: bool) -> None:
        # called as the builder calls it (plugin API 2)
        self.alloc = factory(num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=0)
        self.log.append(f"factory({num_blocks}, {block_size}, enable_prefix_caching={caching}, num_cpu_blocks=0)")

    def _pick(self, pool: dict[str, Request], i: int) -> Request:
        return pool[sorted(pool)[i % len(pool)]]

    def _try(self, r: Request, num_tokens: int) -> bool:
        everyone = [*self.live.values(), *self.preempted.values(), r]
        before, old = _state(self.alloc, everyone), list(r.block_ids)
        got = self.alloc.allocate_slots(r, num_tokens)
        self.log.append(f"allocate_slots({r.request_id}, {num_tokens}) -> {got}")
        if got is None:
            if _state(self.alloc, everyone) != before:
                raise self.fail(
                    f"allocate_slots({r.request_id}, {num_tokens}) returned None (no room) but changed "
                    f"state ({before} -> {_state(self.alloc, everyone)}); a refusal must change nothing, "
                    f"so that the scheduler can preempt and retry"
                )
            return False
        if r.block_ids[: len(old)] != old or r.block_ids[len(old) :] != list(got):
            raise self.fail(
                f"allocate_slots({r.request_id}, {num_tokens}) returned {got} but the table went from "
                f"{old} to {r.block_ids}: return exactly the ids appended to request.block_ids"
            )
        if len(r.block_ids) * self.alloc.block_size < num_tokens:
            raise self.fail(
                f"allocate_slots({r.request_id}, {num_tokens}) granted a table of {len(r.block_ids)} "
                f"blocks, which holds fewer than {num_tokens} tokens"
            )
        return True

    @precondition(lambda self: self.alloc is not None)
    @rule(prompt_len=st.integers(1, 40))
    def allocate(self, prompt_len: int) -> None:
        i = len(self.tokens)
        prompt = [self.rng.randrange(10, 50_000) for _ in range(prompt_len)]  # no two prompts share a prefix
        r = Request(request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=16), arrival=i)
        self.tokens[r.request_id] = prompt_len
        if self._try(r, prompt_len):
            r.num_computed_tokens = prompt_len  # the prefill wrote the prompt's K/V
            self.live[r.request_id] = r

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000), k=st.integers(1, 16))
    def append(self, i: int, k: int) -> None:
        r = self._pick(self.live, i)
        total = self.tokens[r.request_id] + min(k, 2 * self.alloc.block_size)
        if self._try(r, total):
            r.output_token_ids.extend(self.rng.randrange(10, 50_000) for _ in range(total - r.num_tokens))
            self.tokens[r.request_id] = r.num_computed_tokens = total

    def _release(self, r: Request, what: str) -> None:
        free_before, held = self.alloc.num_free_blocks(), len(r.block_ids)
        self.alloc.free(r)
        self.log.append(f"free({r.request_id}) [{what}]")
        if r.block_ids:
            raise self.fail(f"free({r.request_id}) left the table {r.block_ids}: free must empty request.block_ids")
        if self.alloc.num_free_blocks() != free_before + held:
            raise self.fail(
                f"free({r.request_id}) of {held} blocks moved num_free_blocks() from {free_before} to "
                f"{self.alloc.num_free_blocks()}; every freed block must be free again"
            )
        del self.live[r.request_id]

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000))
    def finish(self, i: int) -> None:
        self._release(self._pick(self.live, i), "finished")

    @precondition(lambda self: self.alloc is not None and self.live)
    @rule(i=st.integers(0, 1000))
    def preempt(self, i: int) -> None:
        r = self._pick(self.live, i)
        self._release(r, "preempted")
        r.num_computed_tokens = 0  # recompute from scratch
        self.preempted[r.request_id] = r

    @precondition(lambda self: self.alloc is not None and self.preempted)
    @rule(i=st.integers(0, 1000))
    def resume(self, i: int) -> None:
        r = self._pick(self.preempted, i)
        if self._try(r, self.tokens[r.request_id]):
            del self.preempted[r.request_id]
            self.live[r.request_id] = r
            r.num_computed_tokens = self.tokens[r.request_id]

    @invariant()
    def blocks_accounted(self) -> None:
        if self.alloc is None:
            return
        owner: dict[int, str] = {}
        for r in self.live.values():
            for b in r.block_ids:
                if not 0 <= b < self.alloc.num_blocks:
                    raise self.fail(f"{r.request_id} holds block {b}, outside [0, {self.alloc.num_blocks})")
                if b in owner:
                    raise self.fail(
                        f"block {b} is owned by both {owner[b]} and {r.request_id}, which share no "
                        f"prefix: a block may have two owners only through fork or a cached prefix"
                    )
                owner[b] = r.request_id
        for r in self.preempted.values():
            if r.block_ids:
                raise self.fail(f"preempted {r.request_id} still holds {r.block_ids}")
        free = self.alloc.num_free_blocks()
        if free + len(owner) != self.alloc.num_blocks:
            raise self.fail(f"leak: {free} free blocks + {len(owner)} owned != {self.alloc.num_blocks} blocks")

    @invariant()
    def usage_agrees(self) -> None:
        if self.alloc is None:
            return
        u = self.alloc.usage()
        used = sum(len(r.block_ids) for r in self.live.values())
        filled = sum(r.num_computed_tokens for r in self.live.values())
        if (u.num_blocks, u.num_used_blocks) != (self.alloc.num_blocks, used) or not filled <= u.num_reserved_slots:
            raise self.fail(f"usage() says {u} but {used} blocks are owned holding {filled} computed tokens")


def allocator_machine(name: str, factory: Any, block_sizes: list[int]) -> type[RuleBasedStateMachine]:
    """The state machine for the allocator strategy `name`: `factory` builds it as the builder does, with
    a block size drawn from `block_sizes`."""

    class AllocatorMachine(AllocatorRules):
        kv_allocator = name

        @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from(block_sizes), caching=st.booleans())
        def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
            self.build(factory, num_blocks, block_size, caching)

    return AllocatorMachine


def check_allocator(name: str, factory: Any, block_sizes: list[int] | None = None) -> None:
    machine = allocator_machine(name, factory, block_sizes or [1, 2, 4, 8])
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)
