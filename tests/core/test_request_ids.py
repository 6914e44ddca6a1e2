"""Request ids: automatic ids skip the ones callers chose, and a request that fails half-way through
add_request leaves nothing behind."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.api.errors import RequestError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def test_automatic_ids_skip_ids_a_caller_took(llm):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    taken = [llm.add_request([5, 6, 7], params, request_id=str(i)) for i in range(3)]
    automatic = llm.add_request([8, 9], params)
    assert automatic not in taken
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert sorted(done) == sorted([*taken, automatic]) and all(o.error is None for o in done.values())


def test_a_request_the_scheduler_refuses_leaves_nothing_behind(llm, monkeypatch):
    scheduler = llm.engine.scheduler
    added = []

    def add_then_fail(request):
        added.append(request)
        if len(added) == 2:
            raise RuntimeError("scheduler failed on the second sample")
        type(scheduler).add(scheduler, request)

    monkeypatch.setattr(scheduler, "add", add_then_fail)
    with pytest.raises(RuntimeError, match="second sample"):
        llm.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=3, seed=1))
    monkeypatch.undo()
    assert not llm.has_unfinished() and not llm.engine.output.groups and not llm.engine.requests
    assert scheduler.allocator.usage().num_used_blocks == 0 and not scheduler.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_a_closed_engine_refuses_to_step(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    llm.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.close()
    with pytest.raises(RequestError, match="closed"):
        llm.step()
