"""Priority in the fcfs scheduler: lower values run first, admitted and preempted by rank (arrival
pushed back `priority_aging_s` per level), so a late high-priority request overtakes a queue of low
ones, and a low one that has waited longer than the aging outranks later high ones: nothing starves.
With every priority equal the order is plain arrival (the random workloads of test_schedulers)."""

from __future__ import annotations

import pytest
from test_sharing_schedulers import TOKEN, make_scheduler, run

from infer import LLM, SamplingParams
from infer.api import StepResult
from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, RequestError
from infer.api.request import Request
from infer.testing.decoder import write_tiny_llamas


def request(i: int, prompt_len: int, max_tokens: int, priority: int = 0, arrival_time: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    return Request(
        f"r{i}", list(range(1, prompt_len + 1)), params, arrival=i, arrival_time=arrival_time,
        eos_token_ids=frozenset({0}),
    )  # fmt: skip


def finish_steps(outs, requests) -> dict[str, int]:
    """The step at which each request produced its last token."""
    last: dict[str, int] = {}
    for step, out in enumerate(outs):
        for s in out.scheduled:
            if s.samples:
                last[s.request.request_id] = step
    return {r.request_id: last[r.request_id] for r in requests}


def test_a_late_high_priority_request_preempts_the_worst_ranked_and_runs_at_once():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    low = [request(i, 4, 40, priority=1) for i in range(3)]
    high = request(3, 4, 5, priority=0)
    outs = run(sched, {0: low, 5: [high]})
    # admitted in the step it arrived: the worst-ranked running low-priority request made room
    assert any(s.request is high for s in outs[5].scheduled)
    assert any(r in outs[5].preempted for r in low[:2])
    steps = finish_steps(outs, low + [high])
    assert steps["r3"] == 5 + 4  # its 5 tokens, one a step, never held back
    assert steps["r3"] < min(steps[r.request_id] for r in low)
    assert all(len(r.output_token_ids) == 40 for r in low) and high.output_token_ids == [TOKEN] * 5


def test_equal_priorities_never_preempt_for_admission():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    first = [request(i, 4, 20) for i in range(2)]
    late = request(2, 4, 5)
    outs = run(sched, {0: first, 3: [late]})
    assert not any(out.preempted for out in outs)
    steps = finish_steps(outs, first + [late])
    assert steps["r2"] > max(steps["r0"], steps["r1"])  # it waits for a free seat


def test_a_low_priority_request_that_waited_past_the_aging_outranks_later_high_ones():
    sched = make_scheduler(max_num_seqs=1, budget=64)
    aging = sched.priority_aging_s
    blocker = request(0, 4, 10, priority=-5)  # runs first and holds the only seat
    old_low = request(1, 4, 3, priority=1, arrival_time=0.0)
    within = request(2, 4, 3, priority=0, arrival_time=0.5 * aging)  # overtakes old_low
    past = request(3, 4, 3, priority=0, arrival_time=1.5 * aging)  # ranks after old_low: aging
    outs = run(sched, {0: [blocker], 1: [old_low, within, past]})
    steps = finish_steps(outs, [blocker, old_low, within, past])
    assert steps["r0"] < steps["r2"] < steps["r1"] < steps["r3"]


def test_a_sampled_row_is_not_lost_when_its_request_is_preempted_for_priority():
    """A victim scheduled earlier in the step leaves it: no token is sampled for a preempted request."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, budget=64, prefix_caching=False)
    low = [request(i, 12, 12, priority=2) for i in range(3)]  # 4 blocks each by step 4: the cache full
    high = request(3, 4, 4, priority=0)
    seen = []

    def sample(out):
        for s in out.scheduled:
            assert s.request not in out.preempted
        seen.extend(out.preempted)
        return StepResult({s.request.request_id: [TOKEN] for s in out.scheduled if s.samples})

    run(sched, {0: low, 4: [high]}, sample=sample)
    assert seen  # the cache was full: admitting `high` preempted
    assert all(len(r.output_token_ids) == 12 for r in low) and len(high.output_token_ids) == 4


@pytest.mark.parametrize("bad", ["high", 1.5, True, 2**31])
def test_a_bad_priority_is_refused_naming_the_field(bad):
    with pytest.raises(RequestError, match="priority"):
        SamplingParams(priority=bad)


@pytest.mark.parametrize("aging", [0.0, -1.0, float("nan")])
def test_a_bad_aging_is_refused(aging):
    with pytest.raises(ConfigError, match="--priority-aging-s"):
        EngineConfig(priority_aging_s=aging).validate()


def test_through_the_engine_a_late_high_priority_request_finishes_first(tmp_path):
    target, _ = write_tiny_llamas(tmp_path)
    greedy = dict(temperature=0, ignore_eos=True)
    with LLM(model=str(target), max_num_seqs=1) as llm:
        alone = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30, **greedy))[0].outputs[0].token_ids
        engine = llm.engine
        low = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, priority=1, **greedy))
        engine.step()
        engine.step()
        high = engine.add_request([9, 8, 7], SamplingParams(max_tokens=6, priority=0, **greedy))
        done = []
        while engine.has_unfinished():
            done += engine.step()
    assert [o.request_id for o in done] == [high, low]
    assert done[1].outputs[0].token_ids == alone  # preempted for `high`, recomputed: the same tokens


def test_priority_outputs_equal_a_run_alone(tmp_path):
    target, _ = write_tiny_llamas(tmp_path)
    greedy = dict(temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7], [4, 4, 4]]
    with LLM(model=str(target), max_num_seqs=1) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, **greedy))]
        mixed = llm.generate(prompts, [SamplingParams(max_tokens=8, priority=p, **greedy) for p in (2, 0, 1)])
    assert [o.outputs[0].token_ids for o in mixed] == alone


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_outputs_carry_the_wait_in_the_queue(tmp_path):
    # one seat: the second request waits in the queue while the first runs all its 8 tokens
    target, _ = write_tiny_llamas(tmp_path)
    with LLM(model=str(target), max_num_seqs=1) as llm:
        first, second = llm.generate([[1, 2, 3], [9, 8, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    for out in (first, second):
        m = out.metrics
        assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["latency_s"]
    assert second.metrics["queue_s"] > first.metrics["queue_s"]
    assert second.metrics["queue_s"] > first.metrics["latency_s"] - first.metrics["ttft_s"]  # 7 steps at least
