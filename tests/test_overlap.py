"""Deferred host work (`infer.overlap`): started once, when the engine's thread next says it waits on
the device; and every decoder's sampling step says so before its tokens come to the host, so the
parallel detokenizer's job runs while the host waits instead of beside the launch of a forward."""

from __future__ import annotations

import threading

import pytest

from infer import SamplingParams, overlap
from infer.llm import LLM
from infer.testing.decoder import write_tiny_llamas


def test_deferred_work_starts_once_at_the_next_wait():
    started = []
    overlap.defer(lambda: started.append("a"))
    overlap.defer(lambda: started.append("b"))
    assert started == []
    overlap.waiting()
    assert started == ["a", "b"]
    overlap.waiting()
    assert started == ["a", "b"]


def test_the_same_start_is_queued_once():
    started = []

    def start() -> None:
        started.append(1)

    for _ in range(3):
        overlap.defer(start)
    overlap.waiting()
    assert started == [1]


def test_a_failing_start_does_not_keep_the_others_from_starting():
    started = []

    def broken() -> None:
        raise RuntimeError("broken")

    overlap.defer(broken)
    overlap.defer(lambda: started.append("after"))
    with pytest.raises(RuntimeError, match="broken"):
        overlap.waiting()
    assert started == ["after"]
    overlap.waiting()  # the queue is empty again


def test_threads_keep_their_own_queues():
    started = []
    overlap.defer(lambda: started.append("main"))
    other = threading.Thread(target=overlap.waiting)
    other.start()
    other.join()
    assert started == []  # another thread's wait is not this thread's
    overlap.waiting()
    assert started == ["main"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llamas(tmp_path_factory.mktemp("overlap"))


@pytest.mark.parametrize(
    "options",
    [{}, {"decoding": "speculative", "draft": "ngram"}, {"decoding": "speculative", "draft": "self", "exit_layer": 1}],
    ids=["autoregressive", "ngram", "self-draft"],
)
def test_every_sampling_step_announces_its_wait(tiny, monkeypatch, options):
    target, _ = tiny
    calls = [0]
    real = overlap.waiting

    def counted() -> None:
        calls[0] += 1
        real()

    monkeypatch.setattr(overlap, "waiting", counted)
    steps = []  # (sampled anything, waits announced during the step)
    with LLM(model=str(target), **options) as llm:
        decoder = llm.engine.decoder
        execute = decoder.execute

        def recorded(out):
            before = calls[0]
            result = execute(out)
            steps.append((bool(result.sampled), calls[0] - before))
            return result

        decoder.execute = recorded
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12]], params)
    sampling = [waits for sampled, waits in steps if sampled]
    assert len(sampling) > 2
    assert all(waits >= 1 for waits in sampling), steps
