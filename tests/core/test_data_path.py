"""The data path is short: `LLM.generate` reaches the model's forward in at most 6 calls.

Counted on the stack at the model's forward (eager, the CPU): the calls of infer's own functions from
`LLM.generate` down, the forward included. A decorator's wrapper from outside infer (torch's
`inference_mode`) is not one of ours and is not counted; the frames are listed on failure. Today:
Engine.generate -> Engine.step_outputs -> decoder.execute -> ModelRunner.execute -> ModelRunner.run ->
model.forward. No executor frame lies between the runner and the forward: the executor is entered
as a context around it, and never calls the runner back.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import infer
from infer import LLM, SamplingParams
from infer.testing.decoder import write_tiny_llamas

PACKAGE = Path(infer.__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target, _ = write_tiny_llamas(tmp_path_factory.mktemp("data-path"))
    return target


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_llm_generate_reaches_the_model_forward_in_at_most_six_calls(tiny, monkeypatch):
    stacks = []
    with LLM(model=str(tiny)) as llm:
        model_class = type(llm.engine.model)
        forward = model_class.forward

        def recorded(self, *args, **kwargs):
            stacks.append([(f.function, Path(f.filename).resolve()) for f in inspect.stack()[1:]])
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(model_class, "forward", recorded)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert stacks
    frames = stacks[0]
    top = next(i for i, (name, path) in enumerate(frames) if name == "generate" and path == PACKAGE / "llm.py")
    ours = [(name, path.relative_to(PACKAGE)) for name, path in frames[:top] if path.is_relative_to(PACKAGE)]
    calls = len(ours) + 1  # the frames under LLM.generate, and the forward itself
    assert calls <= 6, list(reversed(ours))
    # no executor frame: it is entered around the forward, not called to run it
    assert [name for name, _ in reversed(ours)] == ["generate", "step_outputs", "execute", "execute", "run"]
