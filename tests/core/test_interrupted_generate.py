"""A `generate` interrupted mid-run (a sampler plugin raising at step N, an ordinary error or
KeyboardInterrupt) drops that call's requests: every KV block is free again, the runners and the
detokenizer are idle, the exception reaches the caller, and the next call runs only its own
requests and gives the same tokens and text as a fresh engine."""

from __future__ import annotations

import pytest

import infer
from infer import SamplingParams
from infer.llm import LLM
from infer.plugins.sampler.vectorized import VectorizedSampler

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3] * 17, [100, 7, 200, 13, 99, 42]]
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class Boom(Exception):
    pass


def tripwire_plugin(trip: dict):
    """A `tripwire` sampler: the vectorized one, recording the request ids of every sampled row and
    raising `trip["error"]` on sampling call number `trip["sample_at"]` (counting from 1)."""

    class Tripwire(VectorizedSampler):
        def _count(self, requests) -> None:
            trip["calls"] += 1
            trip["seen"].update(r.request_id for r in requests)
            if trip["calls"] == trip.get("sample_at"):
                raise trip["error"]

        def sample(self, logits, requests, positions=None):
            self._count(requests)
            return super().sample(logits, requests, positions)

        def sample_tokens(self, logits, requests, positions=None):
            self._count(requests)
            return super().sample_tokens(logits, requests, positions)

    class Plugin:
        @staticmethod
        @infer.hookimpl
        def infer_register_samplers(register):
            register("tripwire", Tripwire)

    trip.update(calls=0, seen=set())
    return Plugin


def check_idle(llm: LLM, free_at_start: int) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.requests == {} and engine.output.groups == {} and engine.output.in_flight == []
    assert engine.scheduler.allocator.num_free_blocks() == free_at_start
    assert engine.kv_usage().num_used_blocks == 0  # prefix-cached blocks are evictable, so free
    assert all(r.pipeline is None or r.pipeline._ahead is None for r in engine.parts.runners)


def trip_after_sampling(llm: LLM, trip: dict) -> None:
    """Raise from the scheduler's update instead, after the sampler ran: a pipelined runner then
    holds a forward queued ahead for the next step."""
    update = llm.engine.scheduler.update

    def tripped(out, result):
        trip["updates"] = trip.get("updates", 0) + 1
        if trip["updates"] == trip.get("update_at"):
            pipeline = llm.engine.parts.runners[0].pipeline
            assert pipeline is None or pipeline._ahead is not None
            raise trip["error"]
        return update(out, result)

    llm.engine.scheduler.update = tripped


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("where", ["sampler", "after-sampling"])
@pytest.mark.parametrize("error", [Boom("sampler exploded"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_interrupted_generate_frees_everything_and_next_call_runs_alone(tiny_llama_dir, error, pipeline, where):
    trip: dict = {}
    options = dict(attention="torch", block_size=4, num_kv_blocks=40, max_model_len=160, pipeline_decode=pipeline)
    llm = LLM(model=str(tiny_llama_dir), sampler="tripwire", plugins=[tripwire_plugin(trip)], **options)
    if where == "after-sampling":
        trip_after_sampling(llm, trip)
    fresh = LLM(model=str(tiny_llama_dir), **options)
    free_at_start = llm.engine.scheduler.allocator.num_free_blocks()
    expected = fresh.generate([PROMPTS[1]], SHORT)[0].outputs[0].token_ids

    trip.update(error=error, **{"sample_at" if where == "sampler" else "update_at": 8})  # mid-decode
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, LONG)
    assert trip["calls"] == 8 and len(trip["seen"]) == len(PROMPTS)  # it broke at step 8
    if pipeline:
        assert llm.engine.stats()["pipelined_steps"] > 0  # a forward was queued ahead when it broke
    check_idle(llm, free_at_start)

    trip.update(sample_at=None, update_at=None, seen=set())
    steps_before, calls_before = llm.engine.num_steps, trip["calls"]
    out = llm.generate([PROMPTS[1]], SHORT)
    assert out[0].error is None and out[0].outputs[0].token_ids == expected
    assert len(trip["seen"]) == 1  # no orphan of the interrupted call was computed
    assert llm.engine.num_steps - steps_before == fresh.engine.num_steps  # as many steps as a fresh engine's
    assert trip["calls"] - calls_before == SHORT.max_tokens  # one sampled row per step, this request's
    check_idle(llm, free_at_start)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_interrupted_generate_leaves_the_detokenizer_consistent(smollm2_dir):
    trip: dict = {}
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=8, temperature=0, stop=[" Paris"])
    options = dict(attention="torch", detokenizer="parallel", pipeline_decode=True)  # a worker thread decodes
    llm = LLM(model=str(smollm2_dir), sampler="tripwire", plugins=[tripwire_plugin(trip)], **options)
    free_at_start = llm.engine.scheduler.allocator.num_free_blocks()
    fresh = [o.outputs[0] for o in llm.generate(prompts, params)]  # the first call: a fresh engine's outputs

    trip.update(calls=0, sample_at=5, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    check_idle(llm, free_at_start)
    assert llm.engine.output.detokenizer._table.streams == {}  # every stream of the dropped requests released

    trip.update(sample_at=None)
    again = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [(o.text, o.token_ids, o.finish_reason) for o in again] == [
        (o.text, o.token_ids, o.finish_reason) for o in fresh
    ]
    assert fresh[0].finish_reason == "stop" and all(o.text for o in fresh[1:])  # the stop string ended the first
    check_idle(llm, free_at_start)
