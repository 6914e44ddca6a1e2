"""The fcfs scheduler with shared KV memory, driven by fake models (no weights).

Chunked prefill never stalls running decodes; preemption by swap resumes without recomputing and
falls back to recompute when the CPU pool is full; parallel samples fork their parent's prompt
blocks; beam groups (forks every step, idle beams, preemption) give exactly the beams of an
independent transcription of HF transformers' beam search loop.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from test_schedulers import HYP, KV, SCHEDULERS, drive, workloads  # the random-workload driver and its checks

from infer.api import StepResult
from infer.api.config import EngineConfig
from infer.api.request import FinishReason, Request, RequestStatus, SamplingParams
from infer.plugins.kv_allocator.paged import PagedAllocator
from infer.plugins.scheduler.fcfs import FcfsScheduler

TOKEN = 7


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=16, budget=64, prefix_caching=True, cpu_blocks=0, mode="recompute"
):
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode)
    return FcfsScheduler(
        config, PagedAllocator(num_blocks, block_size, enable_prefix_caching=prefix_caching, num_cpu_blocks=cpu_blocks)
    )


def request(i: int, prompt: list[int], params: SamplingParams, parent: Request | None = None) -> Request:
    return Request(f"r{i}", list(prompt), params, arrival=i, eos_token_ids=frozenset({0}), fork_parent=parent)


def run(sched, arrivals: dict[int, list[Request]], sample=None, max_steps: int = 2000) -> list:
    """Step until done; `sample(out)` -> StepResult (default: TOKEN for every sampled row)."""
    sample = sample or (lambda out: StepResult({s.request.request_id: [TOKEN] for s in out.scheduled if s.samples}))
    outs, step = [], 0
    while step < max_steps and (sched.has_unfinished() or any(k >= step for k in arrivals)):
        for r in arrivals.get(step, []):
            sched.add(r)
        out = sched.schedule()
        outs.append(out)
        sched.update(out, sample(out))
        step += 1
    assert not sched.has_unfinished(), "hung"
    alloc = sched.allocator
    assert alloc.num_free_blocks() == alloc.num_blocks and not alloc.owners and not alloc.swap.tables
    return outs


# --------------------------------------------------------------------------- random workloads

KV_MODES = {
    "prefix-caching": KV(prefix_caching=True),
    "swap": KV(num_cpu_blocks=6, preemption_mode="swap"),
    "swap-tiny-cpu-pool+prefix-caching": KV(prefix_caching=True, num_cpu_blocks=2, preemption_mode="swap"),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("mode", list(KV_MODES), ids=list(KV_MODES))
@pytest.mark.parametrize("cls", SCHEDULERS, ids=["fcfs", "static"])
@settings(HYP, max_examples=100)
@given(wl=workloads(with_aborts=True))
def test_random_workloads_with_sharing_and_swap(cls, mode, wl):
    """Every promise of test_schedulers.drive (no leak, no hang, FCFS order, decodes never stalled,
    latest preempted first, nothing admitted in a step that preempted) with shared memory."""
    drive(cls, wl, kv=KV_MODES[mode])


# --------------------------------------------------------------------------- chunked prefill


def test_long_prompt_arriving_mid_run_never_stalls_running_decodes():
    sched = make_scheduler(budget=8)
    short = [request(i, [1 + i, 2, 3], SamplingParams(max_tokens=30)) for i in range(3)]
    long = request(3, list(range(10, 90)), SamplingParams(max_tokens=4))
    chunks = []
    for step in range(200):
        if step == 0:
            for r in short:
                sched.add(r)
        if step == 4:
            sched.add(long)
        decoding = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        out = sched.schedule()
        scheduled = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert all(scheduled.get(r.request_id) == 1 for r in decoding), f"step {step}: a decode stalled: {scheduled}"
        if long.request_id in scheduled and long.is_prefilling:
            chunks.append(scheduled[long.request_id])
            assert scheduled[long.request_id] <= 8 - len(decoding)
        sched.update(out, StepResult({s.request.request_id: [TOKEN] for s in out.scheduled if s.samples}))
        if not sched.has_unfinished():
            break
    assert sum(chunks) == long.num_prompt_tokens and len(chunks) > 10  # really chunked, beside the decodes
    assert all(len(r.output_token_ids) == 30 for r in short) and len(long.output_token_ids) == 4


# --------------------------------------------------------------------------- preemption


def test_swap_preemption_resumes_without_recompute():
    # 8 blocks of 4: three requests of 4 + 10 tokens cannot all stay
    sched = make_scheduler(num_blocks=8, prefix_caching=False, cpu_blocks=16, mode="swap")
    rs = [request(i, [1 + i] * 4, SamplingParams(max_tokens=10)) for i in range(3)]

    def sample(out):
        for s in out.scheduled:  # a swapped request comes back as a decode, never a re-prefill
            assert s.num_new_tokens == 1 or s.request.num_preemptions == 0
        return StepResult({s.request.request_id: [TOKEN] for s in out.scheduled if s.samples})

    outs = run(sched, {0: rs}, sample=sample)
    assert sched.num_swap_preemptions > 0 and sched.num_preemptions == sched.num_swap_preemptions
    assert any(out.block_ops.swap_out for out in outs) and any(out.block_ops.swap_in for out in outs)
    assert all(not (out.block_ops.swap_out and out.block_ops.swap_in) for out in outs)
    assert all(len(r.output_token_ids) == 10 for r in rs)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    sched = make_scheduler(num_blocks=8, prefix_caching=False, cpu_blocks=3, mode="swap")
    rs = [request(i, [1 + i] * 4, SamplingParams(max_tokens=12)) for i in range(5)]
    run(sched, {0: rs})
    stats = sched.stats()
    assert stats["preemptions_swap"] > 0 and stats["preemptions_recompute"] > 0
    assert all(len(r.output_token_ids) == 12 for r in rs)


def test_preempted_requests_resume_before_new_ones_are_admitted():
    sched = make_scheduler(num_blocks=8, prefix_caching=False, cpu_blocks=16, mode="swap")
    rs = [request(i, [1 + i] * 4, SamplingParams(max_tokens=10)) for i in range(3)]
    late = request(3, [9] * 2, SamplingParams(max_tokens=2))
    seen = []

    def sample(out):
        if any(s.request is late for s in out.scheduled) and not seen:
            seen.append(True)
            assert not [r for r in sched.waiting if r.status is RequestStatus.PREEMPTED], (
                "admitted past a preempted request"
            )
        return StepResult({s.request.request_id: [TOKEN] for s in out.scheduled if s.samples})

    run(sched, {0: rs, 3: [late]}, sample=sample)
    assert sched.num_preemptions > 0 and seen and len(late.output_token_ids) == 2


# --------------------------------------------------------------------------- parallel samples


def test_parallel_samples_fork_their_parents_prompt_blocks():
    sched = make_scheduler(block_size=4)
    params = SamplingParams(n=3, max_tokens=5)
    parent = request(0, list(range(1, 11)), params)  # 10 tokens: blocks 4 + 4 + 2
    kids = [request(i, parent.prompt_token_ids, params, parent) for i in (1, 2)]
    sched.add(parent)
    for k in kids:
        sched.add(k)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [parent], "samples wait for the parent's prompt"
    sched.update(out, StepResult({parent.request_id: [TOKEN]}))
    out = sched.schedule()
    firsts = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert firsts == {"r0": 1, "r1": 1, "r2": 1}, "a forked sample computes only the last prompt token"
    ref = sched.allocator.pool.ref_counts
    assert kids[0].block_ids[:2] == kids[1].block_ids[:2] == parent.block_ids[:2]
    assert all(ref[b] == 3 for b in parent.block_ids[:2])
    # the shared partly filled third block was copied for every writer but the last
    assert len({parent.block_ids[2], kids[0].block_ids[2], kids[1].block_ids[2]}) == 3
    assert len(out.block_ops.copies) == 2
    assert sched.allocator.usage().num_saved_blocks == 4
    sched.update(out, StepResult({s.request.request_id: [TOKEN] for s in out.scheduled}))
    run(sched, {})
    assert all(len(r.output_token_ids) == 5 for r in [parent, *kids])


# --------------------------------------------------------------------------- beam search

VOCAB = 8


def fake_logprobs(tokens: list[int]) -> torch.Tensor:
    """A deterministic 'model': next-token logprobs [V] float32 from the whole sequence."""
    logits = torch.tensor([hash((tuple(tokens), t)) % 997 / 97.0 for t in range(VOCAB)], dtype=torch.float32)
    return torch.log_softmax(logits, dim=-1)


def sample_fake(out) -> StepResult:
    sampled, logprobs = {}, {}
    for s in out.scheduled:
        if not s.samples:
            continue
        r = s.request
        lp = fake_logprobs(r.all_token_ids)
        top = lp.topk(min(r.params.logprobs or 0, VOCAB))
        sampled[r.request_id] = [int(lp.argmax())]
        logprobs[r.request_id] = [{int(t): float(v) for t, v in zip(top.indices, top.values)}]
    return StepResult(sampled, logprobs)


def hf_beam_search(prompt, width, n, max_new, stops, length_penalty, early_stopping):
    """HF transformers 5.x `_beam_search` for one prompt, transcribed on full-vocabulary tensors."""
    keep = max(2, 1 + len(stops)) * width
    running = [[] for _ in range(width)]
    run_scores = torch.tensor([0.0] + [-1e9] * (width - 1))
    fin_scores, fin_seqs, fin_flags = (
        torch.full((width,), -1e9),
        [[] for _ in range(width)],
        torch.zeros(width, dtype=torch.bool),
    )
    is_open = torch.tensor(True)
    for cur in range(max_new):
        acc = (torch.stack([fake_logprobs(prompt + seq) for seq in running]) + run_scores[:, None]).flatten()
        top_v, top_i = torch.topk(acc, keep)
        seqs = [running[i // VOCAB] + [i % VOCAB] for i in top_i.tolist()]
        hits = torch.tensor([cur + 1 >= max_new or s[-1] in stops for s in seqs])
        run_lp = top_v + hits.to(torch.float32) * -1.0e9
        nxt = torch.topk(run_lp, width).indices
        running, run_scores = [seqs[i] for i in nxt.tolist()], run_lp[nxt]
        top_w = torch.arange(keep) < width
        norm = top_v / ((cur + 1) ** length_penalty)
        norm = norm + (fin_flags.all() & (early_stopping is True)).to(torch.float32) * -1.0e9
        norm = norm + (~is_open).to(torch.float32) * -1.0e9 + (~(hits & top_w)).to(torch.float32) * -1.0e9
        merged = torch.cat([fin_scores, norm])
        best_idx = torch.topk(merged, width).indices.tolist()
        all_seqs, all_flags = fin_seqs + seqs, torch.cat([fin_flags, hits & top_w])
        fin_scores, fin_seqs, fin_flags = merged[best_idx], [all_seqs[i] for i in best_idx], all_flags[best_idx]
        length = max_new if early_stopping == "never" and length_penalty > 0 else cur + 1
        best = run_scores[:1] / (length**length_penalty)
        worst = torch.where(fin_flags, fin_scores.min(), torch.tensor(-1.0e9))
        is_open = is_open & (best > worst).any()
        if not (is_open and not (fin_flags.all() and early_stopping is True) and not hits.all()):
            break
    return fin_seqs[:n]


BEAM_CASES = {
    "width 3, length only": dict(width=3, n=2, max_new=6, stops=frozenset(), lp=1.0, es=False),
    "width 4, eos, lp 1": dict(width=4, n=3, max_new=9, stops=frozenset({0}), lp=1.0, es=False),
    "width 2, eos, lp 2": dict(width=2, n=1, max_new=8, stops=frozenset({0, 5}), lp=2.0, es=False),
    "width 3, eos, early": dict(width=3, n=3, max_new=10, stops=frozenset({0}), lp=0.5, es=True),
    "width 3, eos, never": dict(width=3, n=1, max_new=7, stops=frozenset({0}), lp=1.5, es="never"),
}


@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "tiny-kv"])
@pytest.mark.parametrize("case", list(BEAM_CASES), ids=list(BEAM_CASES))
def test_beam_groups_match_hf_beam_search(case, num_blocks):
    c = BEAM_CASES[case]
    sched = make_scheduler(num_blocks=num_blocks, block_size=2, budget=16)
    prompts = [[1, 2, 3], [3, 1], [2, 2, 2, 2, 1]]
    groups = []
    for g, prompt in enumerate(prompts):
        params = SamplingParams(
            use_beam_search=True,
            best_of=c["width"],
            n=c["n"],
            max_tokens=c["max_new"],
            length_penalty=c["lp"],
            early_stopping=c["es"],
            ignore_eos=0 not in c["stops"],
            stop_token_ids=sorted(c["stops"] - {0}),
        )
        slots = []
        for i in range(c["width"]):
            slots.append(request(10 * g + i, prompt, params, slots[0] if slots else None))
        groups.append(slots)
    run(sched, {0: [s for slots in groups for s in slots]}, sample=sample_fake)
    for prompt, slots in zip(prompts, groups):
        want = hf_beam_search(prompt, c["width"], c["n"], c["max_new"], c["stops"], c["lp"], c["es"])
        assert [s.output_token_ids for s in slots[: c["n"]]] == want, (prompt, case)
        for s in slots[: c["n"]]:
            stopped = s.output_token_ids[-1] in c["stops"]
            assert s.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    if num_blocks == 9:
        assert sched.num_preemptions > 0, "the tiny cache should have forced beams out"


def test_aborting_one_beam_ends_its_group():
    sched = make_scheduler()
    params = SamplingParams(use_beam_search=True, best_of=3, max_tokens=20)
    slots = [request(0, [1, 2, 3], params)]
    slots += [request(i, [1, 2, 3], params, slots[0]) for i in (1, 2)]
    for s in slots:
        sched.add(s)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, sample_fake(out))
    assert sched.allocator.usage().num_saved_blocks > 0, "beams share their prefix blocks"
    sched.abort(slots[1].request_id)
    assert all(s.finish_reason is FinishReason.ABORT and s.block_ids == [] for s in slots)
    assert not sched.has_unfinished() and sched.allocator.num_free_blocks() == sched.allocator.num_blocks
