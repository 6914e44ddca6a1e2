"""Deferred host work (`infer.api.DeviceWaits`): started once, when the engine's thread next says it
waits on the device; every decoder's sampling step says so before its tokens come to the host, and
the detokenizer the engine builds defers through the same object, so the parallel detokenizer's job
runs while the host waits instead of beside the launch of a forward."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.api import DeviceWaits
from infer.api.hookspecs import hookimpl
from infer.llm import LLM
from infer.plugins.detokenizer.sequential import SequentialDetokenizer
from infer.testing.decoder import write_tiny_llamas


def test_deferred_work_starts_once_at_the_next_wait():
    waits, started = DeviceWaits(), []
    waits.defer(lambda: started.append("a"))
    waits.defer(lambda: started.append("b"))
    assert started == []
    waits.waiting()
    assert started == ["a", "b"]
    waits.waiting()
    assert started == ["a", "b"]


def test_the_same_start_is_queued_once():
    waits, started = DeviceWaits(), []

    def start() -> None:
        started.append(1)

    for _ in range(3):
        waits.defer(start)
    waits.waiting()
    assert started == [1]


def test_a_failing_start_does_not_keep_the_others_from_starting():
    waits, started = DeviceWaits(), []

    def broken() -> None:
        raise RuntimeError("broken")

    waits.defer(broken)
    waits.defer(lambda: started.append("after"))
    with pytest.raises(RuntimeError, match="broken"):
        waits.waiting()
    assert started == ["after"]
    waits.waiting()  # the queue is empty again
    assert started == ["after"]


def test_engines_keep_their_own_waits():
    first, second, started = DeviceWaits(), DeviceWaits(), []
    first.defer(lambda: started.append("first"))
    second.waiting()
    assert started == []  # another engine's wait is not this one's
    first.waiting()
    assert started == ["first"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llamas(tmp_path_factory.mktemp("overlap"))


@pytest.mark.parametrize(
    "options",
    [{}, {"decoding": "speculative", "draft": "ngram"}, {"decoding": "speculative", "draft": "self", "exit_layer": 1}],
    ids=["autoregressive", "ngram", "self-draft"],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_every_sampling_step_announces_its_wait(tiny, monkeypatch, options):
    target, _ = tiny
    calls = [0]
    real = DeviceWaits.waiting

    def counted(self: DeviceWaits) -> None:
        calls[0] += 1
        real(self)

    monkeypatch.setattr(DeviceWaits, "waiting", counted)
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


class DeferringDetokenizer(SequentialDetokenizer):
    """Decodes in `submit`, and defers a marker through the engine's waits: it must start at a wait."""

    built: list[DeferringDetokenizer] = []

    def __init__(self, tokenizer, waits: DeviceWaits) -> None:
        super().__init__(tokenizer, waits)
        self.waits = waits
        self.deferred = self.started = self.collected_unstarted = 0
        self._pending = False
        DeferringDetokenizer.built.append(self)

    def submit(self, updates):
        super().submit(updates)
        self.deferred += 1
        self._pending = True
        self.waits.defer(self._start)

    def _start(self) -> None:
        self.started += 1
        self._pending = False

    def collect(self):
        self.collected_unstarted += self._pending  # the engine collects after the next forward's wait
        return super().collect()


class DeferringPlugin:
    @hookimpl
    def infer_register_detokenizers(self, register):
        register("deferring", DeferringDetokenizer)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("options", [{}, {"decoding": "speculative", "draft": "ngram"}], ids=["plain", "ngram"])
def test_the_detokenizer_defers_to_the_waits_its_engine_announces(tiny, smollm2_dir, options):
    target, _ = tiny
    DeferringDetokenizer.built.clear()
    plugins = [DeferringPlugin()]
    with LLM(model=str(target), tokenizer=str(smollm2_dir), detokenizer="deferring", plugins=plugins, **options) as llm:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12]], params)
    assert all(len(o.outputs[0].token_ids) == 10 for o in out)
    (detok,) = DeferringDetokenizer.built
    assert detok.deferred >= 5
    # every job but the last (collected by a step with nothing left to run, so no wait) started at a wait
    assert detok.collected_unstarted <= 1
    assert detok.started == detok.deferred - detok.collected_unstarted


class OldDetokenizer(SequentialDetokenizer):
    """A plugin API 2.0 detokenizer: its factory takes the tokenizer alone."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)


class OldPlugin:
    @hookimpl
    def infer_register_detokenizers(self, register):
        register("old-form", OldDetokenizer)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_plugin_api_2_0_detokenizer_still_works_with_a_warning_naming_the_new_form(tiny, smollm2_dir):
    target, _ = tiny
    with pytest.warns(DeprecationWarning, match=r"'old-form'.*factory\(tokenizer, waits: infer.api.DeviceWaits\)"):
        llm = LLM(model=str(target), tokenizer=str(smollm2_dir), detokenizer="old-form", plugins=[OldPlugin()])
    with llm:
        out = llm.generate([[10, 11, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    text = out[0].outputs[0].text  # an incomplete character at the end is held back
    assert text and llm.tokenizer.decode(out[0].outputs[0].token_ids, skip_special_tokens=True).startswith(text)
