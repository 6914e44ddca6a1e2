"""The step budget (`max_step_ms`): on a simulated device whose step costs a + b * tokens it settles where a
step takes the target, keeps the configured budget on a fast device, grows only from steps that used it;
in the engine, a long prompt is chunked so that the steps of a stream beside it stay near the target."""

from __future__ import annotations

import time

import pytest

from infer import LLM, SamplingParams
from infer.core.step_budget import FIRST_TOKENS, MIN_TOKENS, StepBudget


def _settle(budget: StepBudget, fixed_s: float, per_token_s: float, steps: int = 30) -> list[float]:
    times = []
    for _ in range(steps):
        elapsed = fixed_s + per_token_s * budget.tokens  # every step has work for its whole budget
        times.append(elapsed)
        budget.observe(budget.tokens, elapsed)
    return times


@pytest.mark.parametrize("fixed_ms, per_token_us", [(0.0, 500.0), (100.0, 400.0), (20.0, 2000.0), (5.0, 50.0)])
def test_it_settles_where_a_step_takes_the_target(fixed_ms, per_token_us):
    budget = StepBudget(target_s=0.5, max_tokens=1 << 20)
    times = _settle(budget, fixed_ms / 1e3, per_token_us / 1e6)
    assert times[-1] == pytest.approx(0.5, rel=0.02)
    assert budget.tokens == pytest.approx((0.5 - fixed_ms / 1e3) / (per_token_us / 1e6), rel=0.02)


def test_a_fast_device_keeps_the_configured_budget():
    budget = StepBudget(target_s=0.5, max_tokens=4096)
    assert budget.tokens == FIRST_TOKENS
    times = _settle(budget, 0.005, 25e-6)  # an H100-like 40k tokens/s
    assert budget.tokens == 4096 and max(times[-5:]) < 0.5


def test_it_stays_within_its_floor_and_moves_at_most_twice_a_step():
    budget = StepBudget(target_s=0.1, max_tokens=4096)
    assert budget.observe(256, 100.0) == 128  # a step far over the target: halved, not cut to nothing
    for _ in range(20):
        budget.observe(budget.tokens, 100.0)
    assert budget.tokens == MIN_TOKENS
    assert budget.observe(MIN_TOKENS, 1e-6) == 2 * MIN_TOKENS


def test_a_fixed_cost_past_the_target_keeps_steps_worth_their_cost():
    """a = 0.4 s alone passes a 0.3 s target: the budget stops at a / b (400 tokens, steps of ~0.8 s),
    not at MIN_TOKENS, where 16-token steps of 0.416 s would take a prompt 12x as long."""
    budget = StepBudget(target_s=0.3, max_tokens=4096)
    times = _settle(budget, 0.4, 1e-3)
    assert budget.tokens == pytest.approx(400, rel=0.05)
    assert times[-1] == pytest.approx(0.8, rel=0.05)


def test_a_long_prompt_whose_context_outgrows_the_target_costs_at_most_twice_its_work():
    """A chunked 8,000-token prompt on a slow device: each step reads the prompt's context so far (a grows to
    ~1 s, past the 0.3 s target) and 2 ms a token. Chunks of MIN_TOKENS would take ~250 s; chunks of a / b
    (probed for as the context grows) keep each step about half work: under 2.5x the 16 s of its tokens."""
    budget = StepBudget(target_s=0.3, max_tokens=4096)
    context, total, steps = 0, 0.0, []
    while context < 8000:
        tokens = min(budget.tokens, 8000 - context)
        fixed = 0.02 + 120e-6 * context
        elapsed = fixed + 2e-3 * tokens
        steps.append((fixed, elapsed))
        total += elapsed
        budget.observe(tokens, elapsed)
        context += tokens
    assert total < 2.5 * 2e-3 * 8000, total
    assert all(elapsed < max(3.5 * fixed, 0.6) for fixed, elapsed in steps), steps  # ~2a; a probe ~3a


def test_steps_short_of_work_do_not_grow_or_shrink_it():
    budget = StepBudget(target_s=0.5, max_tokens=4096)
    budget.observe(256, 0.01)
    grown = budget.tokens
    assert budget.observe(20, 0.001) == grown  # a few decodes, fast: says nothing of a prefill's cost
    assert budget.observe(8, 10.0) == grown  # too few tokens to tell


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_long_prompt_is_chunked_to_the_target_beside_a_stream(smollm2_dir):
    """SmolLM2 on the CPU with max_step_ms=100: a 1,500-token prompt arrives beside a stream; it runs in
    chunks, and the stream gets a token every step. Without the budget its first chunk is the whole
    prompt, one step of seconds; with it, the median step is a fraction of that step, timed in the same
    run on the same machine (absolute times on two shared cores vary with what else runs)."""
    llm = LLM(model=str(smollm2_dir), attention="torch", max_model_len=2048, max_step_ms=100.0)
    try:
        engine = llm.engine
        stream = engine.add_request([1] * 8, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        for _ in range(8):  # the budget settles on the stream's steps and a warm-up prompt's chunks
            engine.step()
        engine.add_request([2] * 300, SamplingParams(max_tokens=1, temperature=0))
        while len(engine.requests) > 1:
            engine.step()
        engine.add_request([3] * 1500, SamplingParams(max_tokens=1, temperature=0))
        times, budgets = [], []
        while len(engine.requests) > 1:
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            budgets.append(engine.parts.scheduler.max_num_batched_tokens)
        assert len(times) >= 4 and max(budgets) < 1500  # chunked
        assert stream in engine.output.groups  # still streaming
        # The same prompt beside the same stream, unchunked: the budget back at the configured one.
        engine.parts.scheduler.set_token_budget(engine.parts.config.max_num_batched_tokens)
        engine._budget = None
        whole = engine.add_request([4] * 1500, SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        engine.step()
        whole_s = time.perf_counter() - start
        assert engine.requests[whole].finish_time is not None  # the whole prompt ran in that one step
        median = sorted(times)[len(times) // 2]
        assert median < whole_s / 3, (median, whole_s, times)
        assert max(times) < whole_s * 0.75, (whole_s, times)
    finally:
        llm.close()
