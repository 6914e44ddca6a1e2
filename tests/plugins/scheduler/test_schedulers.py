"""FcfsScheduler and StaticScheduler driven by a fake decoder loop (no model).

Each step: `schedule()`, then every scheduled sequence whose step completes its known tokens
(`.samples`) gets one fixed token, then `update()`. Hypothesis draws workloads (arrivals over
time, prompt lengths, max_tokens, context limits, tiny KV caches, token budgets, aborts) and the
driver checks the schedulers' promises at every step and at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.api import SchedulerOutput, StepResult
from infer.api.config import EngineConfig
from infer.api.request import FinishReason, Request, RequestStatus, SamplingParams
from infer.plugins.kv_allocator.contiguous import ContiguousAllocator
from infer.plugins.kv_allocator.paged import PagedAllocator
from infer.plugins.scheduler.fcfs import FcfsScheduler
from infer.plugins.scheduler.static import StaticScheduler

TOKEN = 7  # what the fake decoder always samples (not an EOS or stop token)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- workload + driver


@dataclass
class Spec:
    arrive_step: int
    prompt: int
    max_tokens: int
    max_model_len: int = 0  # 0: none; else > prompt, as the engine guarantees


@dataclass
class Workload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    specs: list[Spec]
    aborts: list[tuple[int, int, str]] = field(default_factory=list)  # (request index, step, "before"|"between")


def expected_outputs(r: Request) -> int:
    n = r.params.max_tokens
    if r.max_model_len:
        n = min(n, r.max_model_len - r.num_prompt_tokens)
    return n


@dataclass(frozen=True)
class KV:
    """How the KV cache is managed: prefix caching, and preemption by recompute or swap."""

    prefix_caching: bool = False
    num_cpu_blocks: int = 0
    preemption_mode: str = "recompute"


def build(cls, wl: Workload, allocator_cls=PagedAllocator, kv: KV = KV()):
    config = EngineConfig(
        max_num_seqs=wl.max_num_seqs,
        max_num_batched_tokens=wl.max_num_batched_tokens,
        preemption_mode=kv.preemption_mode,
    )
    allocator = allocator_cls(
        wl.num_blocks, wl.block_size, enable_prefix_caching=kv.prefix_caching, num_cpu_blocks=kv.num_cpu_blocks
    )
    return cls(config, allocator)


def make_request(i: int, spec: Spec) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=[1 + (j % 5) for j in range(spec.prompt)],
        params=SamplingParams(max_tokens=spec.max_tokens),
        arrival=i,
        max_model_len=spec.max_model_len,
    )


def rids(requests) -> set[str]:
    return {r.request_id for r in requests}


def check_blocks(sched) -> None:
    """Only running requests hold device blocks (swapped ones hold CPU blocks); refcount = tables
    holding a block (prefix caching shares them); cached blocks stay cached; nothing leaks."""
    alloc = sched.allocator
    pool = alloc.pool
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), "duplicate on the free lists"
    for r in sched.waiting:
        assert r.block_ids == [], f"waiting {r.request_id} holds blocks {r.block_ids}"
    assert set(alloc.swap.tables) <= {r.request_id for r in sched.waiting}, "a swapped request is not waiting"
    held: dict[int, int] = {}
    for r in sched.running:
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    if alloc.cache is None:
        assert all(n == 1 for n in held.values()), f"a block is in two tables without sharing: {held}"
    else:
        assert set(pool.evictable) == {b for b in alloc.cache.keys if b not in held}
    assert not set(held) & set(free)
    assert len(held) + len(free) == alloc.num_blocks, "leaked blocks"
    assert all(pool.ref_counts[b] == held.get(b, 0) for b in range(alloc.num_blocks))
    assert set(alloc.owners) == {r.request_id for r in sched.running}


@dataclass
class Trace:
    requests: list[Request]
    steps: int = 0
    outs: list[SchedulerOutput] = field(default_factory=list)
    preempted_any: bool = False
    aborted: set[str] = field(default_factory=set)
    stats: dict = field(default_factory=dict)


def max_steps_for(wl: Workload) -> int:
    # every step advances the earliest running request (or finishes it); recompute after
    # preemption repeats at most all tokens once per later arrival, so this is generous
    total = sum(s.prompt + s.max_tokens for s in wl.specs)
    last_arrival = max((s.arrive_step for s in wl.specs), default=0)
    return last_arrival + 50 + total * (len(wl.specs) + 1) * 2


def drive(
    cls, wl: Workload, allocator_cls=PagedAllocator, lookahead: int = 0, max_steps: int | None = None, kv: KV = KV()
) -> Trace:
    sched = build(cls, wl, allocator_cls, kv)
    sched.num_lookahead_tokens = lookahead
    is_fcfs = cls is FcfsScheduler
    order = sorted(range(len(wl.specs)), key=lambda i: wl.specs[i].arrive_step)
    specs = [wl.specs[i] for i in order]  # arrival index follows the time of arrival
    requests = [make_request(i, s) for i, s in enumerate(specs)]
    trace = Trace(requests)
    reported: dict[str, int] = {}  # request id -> times returned as finished
    aborts = {(step, phase): [] for _, step, phase in wl.aborts}
    for idx, step, phase in wl.aborts:
        aborts[(step, phase)].append(order.index(idx) if idx < len(order) else idx)
    added = 0
    limit = max_steps if max_steps is not None else max_steps_for(wl)

    def do_aborts(step: int, phase: str) -> None:
        for i in aborts.get((step, phase), []):
            if i >= added:
                continue  # not arrived yet
            r = requests[i]
            was_finished = r.is_finished
            # a shared block stays held by its other tables
            n_free, n_held = (
                sched.allocator.num_free_blocks(),
                sum(sched.allocator.pool.ref_counts[b] == 1 for b in r.block_ids),
            )
            got = sched.abort(r.request_id)
            if was_finished:
                assert got is None
                continue
            assert got is r and r.is_finished and r.finish_reason is FinishReason.ABORT
            assert r.block_ids == [], "abort must free the request's blocks"
            assert sched.allocator.num_free_blocks() == n_free + n_held
            assert r not in sched.running and r not in sched.waiting
            trace.aborted.add(r.request_id)
            check_blocks(sched)

    step = 0
    while added < len(requests) or sched.has_unfinished():
        assert step < limit, (
            f"no progress after {step} steps: waiting={[r.request_id for r in sched.waiting]} running={[r.request_id for r in sched.running]}"
        )
        while added < len(requests) and specs[added].arrive_step <= step:
            sched.add(requests[added])
            added += 1
        do_aborts(step, "before")
        check_blocks(sched)

        before_running = list(sched.running)
        before_status = {r.request_id: r.status for r in requests[:added]}
        decoding = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        preempted_waiting = [r for r in sched.waiting if r.status is RequestStatus.PREEMPTED]
        out = sched.schedule()
        if is_fcfs and any(r in sched.waiting for r in preempted_waiting):  # PagedAttention's policy
            admitted = [r.request_id for r in sched.running if before_status[r.request_id] is RequestStatus.WAITING]
            assert not admitted, f"admitted {admitted} while a preempted request still waits"
        trace.outs.append(out)
        check_blocks(sched)

        # ---- what one step may schedule
        nums = [s.num_new_tokens for s in out.scheduled]
        first_prefill = next((k for k, n in enumerate(nums) if n != 1), len(nums))
        assert all(n != 1 for n in nums[first_prefill:]), f"decodes must come before prefills: {nums}"
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert len(sched.running) <= wl.max_num_seqs
        assert len(out.scheduled) <= wl.max_num_seqs
        if is_fcfs:
            assert out.num_tokens <= wl.max_num_batched_tokens, (
                f"{out.num_tokens} tokens > budget {wl.max_num_batched_tokens}"
            )
        for s in out.scheduled:
            r = s.request
            assert r.status is RequestStatus.RUNNING and r in sched.running
            assert 1 <= s.num_new_tokens <= r.num_tokens - r.num_computed_tokens
            assert s.num_lookahead_tokens == lookahead
            need = r.num_computed_tokens + s.num_new_tokens + lookahead
            assert len(r.block_ids) * wl.block_size >= need, f"{r.request_id}: table too short for {need} slots"
        for r in out.finished:
            assert r.is_finished and r.finish_reason is FinishReason.CAPACITY and r.block_ids == []
        if is_fcfs and not out.preempted and len(decoding) <= wl.max_num_batched_tokens:
            # running decodes come before any prefill chunk: a long prompt never stalls them
            stalled = [r.request_id for r in decoding if r.request_id not in ids and not r.is_finished]
            assert not stalled, f"running decodes not scheduled: {stalled} (scheduled {ids})"

        # ---- preemption (fcfs): victims are the latest-arrived running requests
        if out.preempted:
            trace.preempted_any = True
            assert is_fcfs
            assert len({r.request_id for r in out.preempted}) == len(out.preempted)
            for r in out.preempted:
                assert r in before_running, "preempted a request that was not running"
                assert r.status is RequestStatus.PREEMPTED and r in sched.waiting
                assert r.block_ids == [] and (r.num_computed_tokens == 0 or sched.allocator.is_swapped(r))
                assert r.request_id not in ids
            arrivals = [r.arrival for r in out.preempted]
            assert arrivals == sorted(arrivals, reverse=True), "victims must be taken latest first"
            assert all(r.arrival < min(arrivals) for r in sched.running), "a later arrival kept running over a victim"
            assert rids(sched.running) <= rids(before_running), "admitted new work in a step that preempted"
        assert [r.arrival for r in sched.running] == sorted(r.arrival for r in sched.running)

        # ---- static: no admission while a batch runs; the whole batch runs every step
        if cls is StaticScheduler:
            if before_running:
                assert rids(sched.running) <= rids(before_running), "static admitted into a running batch"
                for r in requests[:added]:
                    if before_status[r.request_id] is not RequestStatus.RUNNING:
                        assert r.status is not RequestStatus.RUNNING
            assert {s.request.request_id for s in out.scheduled} == {r.request_id for r in sched.running}

        # ---- the fake decoder
        sampled = {s.request.request_id: [TOKEN] for s in out.scheduled if s.samples}
        do_aborts(step, "between")
        finished = sched.update(out, StepResult(sampled=sampled))
        check_blocks(sched)
        assert all(r in finished for r in out.finished)
        for r in finished:
            assert r.is_finished and r.block_ids == []
            reported[r.request_id] = reported.get(r.request_id, 0) + 1
        for r in sched.running:
            assert r.num_computed_tokens < r.num_tokens, "a running request must have a token left to compute"
        step += 1

    trace.steps = step
    alloc = sched.allocator
    assert alloc.num_free_blocks() == alloc.num_blocks, "blocks still owned at the end"
    assert alloc.usage().num_used_blocks == 0 and not alloc.owners
    assert not alloc.swap.tables and alloc.swap.pool.num_free() == alloc.swap.pool.num_blocks, "CPU blocks still owned"
    trace.stats = sched.stats()

    for r in requests:
        assert r.is_finished, r.request_id
        assert r.block_ids == []
        assert all(t == TOKEN for t in r.output_token_ids)
        if r.request_id in trace.aborted:
            assert r.finish_reason is FinishReason.ABORT
            assert reported.get(r.request_id, 0) == 0
            continue
        assert reported.get(r.request_id) == 1, (
            f"{r.request_id} reported finished {reported.get(r.request_id, 0)} times"
        )
        want = expected_outputs(r)
        if r.finish_reason is FinishReason.CAPACITY:
            assert len(r.output_token_ids) < want
            if is_fcfs:
                # finished only when it could not grow even alone in the whole cache
                assert not alloc.can_ever_run(r, r.num_tokens + 1 + lookahead), (r.request_id, r.num_tokens)
            else:
                # static reserves the whole length up front; it may only fall short when that could never fit
                full = r.num_prompt_tokens + r.params.max_tokens
                if r.max_model_len:
                    full = min(full, r.max_model_len)
                assert not alloc.can_ever_fit(full + lookahead) or not alloc.can_ever_run(
                    r, r.num_tokens + 1 + lookahead
                )
        else:
            assert r.finish_reason is FinishReason.LENGTH, (r.request_id, r.finish_reason)
            assert len(r.output_token_ids) == want, (r.request_id, len(r.output_token_ids), want)
    return trace


# --------------------------------------------------------------------------- strategies


@st.composite
def specs(draw, capacity: int, max_requests: int = 7) -> list[Spec]:
    n = draw(st.integers(1, max_requests))
    out = []
    for _ in range(n):
        # mostly prompts that fit, some that overflow the tiny cache
        prompt = draw(st.integers(1, 6) | st.integers(1, max(1, capacity // 2)) | st.integers(1, capacity + 4))
        max_tokens = draw(st.integers(1, 12))
        mml = draw(st.none() | st.integers(1, 12))
        out.append(Spec(draw(st.integers(0, 8)), prompt, max_tokens, 0 if mml is None else prompt + mml))
    return out


@st.composite
def workloads(draw, with_aborts: bool = False) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(1, 12))
    wl = Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        specs=draw(specs(num_blocks * block_size)),
    )
    if with_aborts:
        wl.aborts = draw(
            st.lists(
                st.tuples(
                    st.integers(0, len(wl.specs) - 1), st.integers(0, 12), st.sampled_from(["before", "between"])
                ),
                max_size=4,
            )
        )
    return wl


SCHEDULERS = [FcfsScheduler, StaticScheduler]
HYP = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
@HYP
@given(wl=workloads())
def test_random_workloads_finish(cls, wl):
    drive(cls, wl)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
@settings(HYP, max_examples=100)
@given(wl=workloads(with_aborts=True))
def test_random_workloads_with_aborts(cls, wl):
    drive(cls, wl)


# --------------------------------------------------------------------------- targeted cases


def test_fcfs_preempts_latest_arrival_under_tiny_cache():
    # 4 blocks of 4 slots; each request needs 4 + 10 - 1 = 13 slots (4 blocks) to finish
    wl = Workload(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, specs=[Spec(0, 4, 10)] * 3)
    trace = drive(FcfsScheduler, wl)
    a, b, c = trace.requests
    assert trace.preempted_any
    first = next(out.preempted for out in trace.outs if out.preempted)
    assert first[0] is c, "the latest arrival goes first"
    assert a.num_preemptions == 0, "the earliest arrival is never preempted"
    assert all(len(r.output_token_ids) == 10 for r in trace.requests)


def test_fcfs_preempted_request_recomputes_prompt_and_output():
    wl = Workload(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, specs=[Spec(0, 4, 10)] * 2)
    trace = drive(FcfsScheduler, wl)
    b = trace.requests[1]
    assert b.num_preemptions >= 1
    # after preemption b is scheduled again from 0 with all its tokens (prompt + output so far)
    resumed = [
        s for out in trace.outs for s in out.scheduled if s.request is b and s.num_new_tokens > b.num_prompt_tokens
    ]
    assert resumed, "the recompute prefill must cover prompt + generated tokens"


def test_fcfs_chunks_long_prompts_to_the_token_budget():
    wl = Workload(
        num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=5, specs=[Spec(0, 23, 3), Spec(0, 3, 3)]
    )
    trace = drive(FcfsScheduler, wl)
    assert all(out.num_tokens <= 5 for out in trace.outs)
    first = [s.num_new_tokens for out in trace.outs for s in out.scheduled if s.request is trace.requests[0]]
    assert first[:5] == [5, 5, 5, 5, 3]


def test_fcfs_respects_max_num_seqs():
    wl = Workload(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, specs=[Spec(0, 3, 4)] * 5)
    trace = drive(FcfsScheduler, wl)
    assert max(len(out.scheduled) for out in trace.outs) == 2


def test_fcfs_capacity_when_prompt_can_never_fit():
    wl = Workload(
        num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[Spec(0, 8, 4), Spec(0, 3, 2)]
    )
    trace = drive(FcfsScheduler, wl)
    big, small = trace.requests
    assert big.finish_reason is FinishReason.CAPACITY and big.output_token_ids == []  # 8 + 1 > 8 slots
    assert small.finish_reason is FinishReason.LENGTH and len(small.output_token_ids) == 2


def test_fcfs_capacity_when_alone_it_cannot_grow():
    wl = Workload(num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[Spec(0, 5, 10)])
    (r,) = drive(FcfsScheduler, wl).requests
    assert r.finish_reason is FinishReason.CAPACITY
    assert r.num_tokens == 9  # grew to fill all 8 slots, the 9th token has nowhere to go


@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
def test_abort_waiting_and_running_frees_blocks(cls):
    sched = build(cls, Workload(num_blocks=6, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, specs=[]))
    a = make_request(0, Spec(0, 6, 8))
    b = make_request(1, Spec(0, 6, 8))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, StepResult(sampled={s.request.request_id: [TOKEN] for s in out.scheduled if s.samples}))
    assert a.status is RequestStatus.RUNNING and a.block_ids and b.status is RequestStatus.WAITING
    assert sched.abort(b.request_id) is b and b.finish_reason is FinishReason.ABORT and b.block_ids == []
    assert sched.abort(a.request_id) is a and a.block_ids == []
    assert sched.allocator.num_free_blocks() == 6 and not sched.has_unfinished()
    assert sched.abort(a.request_id) is None and sched.abort("nope") is None


@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
def test_abort_between_schedule_and_update(cls):
    sched = build(cls, Workload(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[]))
    a, b = make_request(0, Spec(0, 5, 4)), make_request(1, Spec(0, 5, 4))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert rids(s.request for s in out.scheduled) == rids([a, b])
    sched.abort(a.request_id)
    finished = sched.update(
        out, StepResult(sampled={s.request.request_id: [TOKEN] for s in out.scheduled if s.samples})
    )
    assert finished == [] and a.output_token_ids == [] and a.block_ids == []
    assert len(b.output_token_ids) == 1
    check_blocks(sched)


def test_static_never_admits_while_its_batch_runs():
    # a slot frees early (r0 stops after 1 token) but r2 waits for the whole batch
    wl = Workload(
        num_blocks=64,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        specs=[Spec(0, 3, 1), Spec(0, 3, 6), Spec(0, 3, 2)],
    )
    trace = drive(StaticScheduler, wl)
    r0, r1, r2 = trace.requests
    r2_first = next(k for k, out in enumerate(trace.outs) if any(s.request is r2 for s in out.scheduled))
    r1_last = max(k for k, out in enumerate(trace.outs) if any(s.request is r1 for s in out.scheduled))
    assert r2_first > r1_last


def test_static_reserves_whole_length_so_batch_never_grows():
    wl = Workload(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[Spec(0, 3, 6)] * 3)
    sched = build(StaticScheduler, wl)
    rs = [make_request(i, s) for i, s in enumerate(wl.specs)]
    for r in rs:
        sched.add(r)
    out = sched.schedule()
    # each needs 9 slots -> 3 blocks; only two fit in 8 blocks
    assert [s.request for s in out.scheduled] == rs[:2]
    assert all(len(r.block_ids) == 3 for r in rs[:2]) and rs[2].block_ids == []


# --------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
def test_lookahead_request_that_cannot_fit_does_not_hang(cls):
    # 8 slots; prompt 7 + 1 fits, but prompt 7 + 2 lookahead slots never does
    wl = Workload(num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[Spec(0, 7, 4)])
    drive(cls, wl, lookahead=2, max_steps=100)


@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
def test_contiguous_request_longer_than_cache_does_not_hang(cls):
    # 8 slots; prompt 4 + 1 fits, the contiguous reservation of 4 + 10 never does
    wl = Workload(num_blocks=2, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, specs=[Spec(0, 4, 10)])
    drive(cls, wl, allocator_cls=ContiguousAllocator, max_steps=100)
