"""The host's share of a decode step: `schedule()` plus `update()` with N requests running.

Every step of the engine runs the scheduler on the host; at large batches a GPU step takes a few
milliseconds, so a scheduler that spends as long would halve throughput. No model: each scheduled
sequence gets one token, as a decoder would return it. The requests have finished their 256-token
prompts before timing starts, so every timed step is a decode step of N sequences growing by one
token (a new KV block every 16 steps). Peer: the static scheduler (no preemption, no admission
work) on the same requests; `extra_info` has the per-request cost.
"""

from __future__ import annotations

import pytest

from infer.api import StepResult
from infer.api.config import EngineConfig
from infer.api.request import Request, SamplingParams
from infer.plugins.kv_allocator.paged import PagedAllocator
from infer.plugins.scheduler.fcfs import FcfsScheduler
from infer.plugins.scheduler.static import StaticScheduler

PROMPT, MAX_TOKENS, BLOCK = 256, 4096, 16
SCHEDULERS = {"fcfs": FcfsScheduler, "static": StaticScheduler}


def decoding(cls, num_running: int, prefix_caching: bool):
    """A scheduler with `num_running` requests past their prompts, and a step function."""
    config = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=64 * 1024)
    blocks = num_running * (PROMPT + MAX_TOKENS) // BLOCK + 1  # every request's whole length: nothing preempted
    scheduler = cls(config, PagedAllocator(blocks, BLOCK, enable_prefix_caching=prefix_caching))
    for i in range(num_running):
        prompt = [(i * 7919 + j) % 32000 for j in range(PROMPT)]  # distinct prompts: nothing shared
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), arrival=i))

    def step() -> int:
        out = scheduler.schedule()
        sampled = {s.request.request_id: [7] for s in out.scheduled if s.samples}
        scheduler.update(out, StepResult(sampled))
        return len(out.scheduled)

    while any(r.num_computed_tokens < PROMPT for r in scheduler.waiting + scheduler.running):
        step()  # prefill
    return scheduler, step


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.benchmark(group="scheduler-step")
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("num_running", [64, 256, 1024])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_decode_step(benchmark, name, num_running, prefix_caching):
    scheduler, step = decoding(SCHEDULERS[name], num_running, prefix_caching)
    assert len(scheduler.running) == num_running
    scheduled = benchmark.pedantic(step, rounds=60, warmup_rounds=5)
    assert scheduled == num_running and len(scheduler.running) == num_running
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        benchmark.extra_info.update(us_per_request=stats.median / num_running * 1e6)
