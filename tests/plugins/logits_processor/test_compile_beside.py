"""An output constraint compiles beside the step loop: a slow compile stalls no other request, a compile past
`structured_compile_timeout_s` refuses its request alone (the limit named), a request that leaves before
its compile starts never compiles, and requests that ask for the same constraint share one compile.

SmolLM2's real tokenizer and vocabulary (what a compile costs depends on them) over a tiny random model."""

from __future__ import annotations

import time

import pytest

from infer import SamplingParams
from infer.api.errors import RequestError
from infer.llm import LLM
from infer.plugins.logits_processor import grammar

# 2,000 optional integer properties (59 KB: within the server's schema limit): seconds to compile on two cores
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}


@pytest.fixture()
def llm(tiny_chat_dir):
    engine = LLM(model=str(tiny_chat_dir), attention="torch", num_kv_blocks=128, max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory, smollm2_dir):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.testing.decoder import TINY_LLAMA

    folder = tmp_path_factory.mktemp("tiny-chat")
    torch.manual_seed(0)
    config = {**TINY_LLAMA, "vocab_size": 49152, "max_position_embeddings": 256}
    LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32")).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


def _step_gaps(engine, request_id: str) -> tuple[list[float], dict]:
    """Step the engine until nothing is unfinished: the wall time of every step while `request_id` ran, and
    the outputs by id."""
    gaps, outputs = [], {}
    while engine.has_unfinished():
        start = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out
        if request_id not in outputs:
            gaps.append(time.perf_counter() - start)
    return gaps, outputs


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_slow_compile_stalls_no_other_request(llm):
    engine = llm.engine
    plain = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there"], plain)[0].outputs[0].token_ids
    started = time.perf_counter()
    slow = engine.add_request("A record:", SamplingParams(max_tokens=4, temperature=0, structured={"json": SLOW}))
    added_in = time.perf_counter() - started
    neighbour = engine.add_request("Hello there", plain)
    gaps, outputs = _step_gaps(engine, neighbour)
    assert added_in < 1.0  # add_request converted the schema only; the compile ran in the pool
    assert outputs[neighbour].outputs[0].token_ids == alone
    assert max(gaps) < 1.0, max(gaps)  # the neighbour's steps went on while the grammar compiled
    assert outputs[slow].error is None and len(outputs[slow].outputs[0].token_ids) == 4
    assert outputs[slow].outputs[0].text.startswith("{")  # constrained: a JSON object begins


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_compile_past_its_budget_refuses_its_request_alone(tiny_chat_dir):
    llm = LLM(
        model=str(tiny_chat_dir),
        attention="torch",
        num_kv_blocks=128,
        max_model_len=256,
        structured_compile_timeout_s=0.3,
    )
    try:
        slow = {**SLOW, "properties": {f"q{i}": {"type": "integer"} for i in range(2000)}}  # not compiled before
        params = [SamplingParams(max_tokens=8, structured={"json": slow}), SamplingParams(max_tokens=8)]
        started = time.perf_counter()
        refused, served = llm.generate(["A record:", "Hello"], params)
        assert time.perf_counter() - started < 5.0  # refused at the deadline, not when the compile ended
        assert refused.error is not None and "structured_compile_timeout_s" in refused.error
        assert "0.3 s" in refused.error and "simplify" in refused.error
        assert served.error is None and len(served.outputs[0].token_ids) == 8
        assert not llm.engine.has_unfinished()
    finally:
        llm.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_bad_constraint_is_refused_at_once(llm):
    with pytest.raises(RequestError, match="invalid structured.json: .*fix the json"):
        llm.engine.add_request("Hi", SamplingParams(max_tokens=4, structured={"json": {"type": "nonsense"}}))
    assert not llm.engine.has_unfinished()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_that_leave_before_their_compile_starts_never_compile(llm, monkeypatch):
    calls = []
    real = grammar.XGrammarProcessor.compile

    def counted(self, spec, grammar_=None):
        calls.append(spec.kind)
        return real(self, spec, grammar_)

    monkeypatch.setattr(grammar.XGrammarProcessor, "compile", counted)
    engine = llm.engine
    first = {**SLOW, "properties": {f"r{i}": {"type": "integer"} for i in range(1500)}}
    busy = engine.add_request("A", SamplingParams(max_tokens=2, structured={"json": first}))
    waiting = [
        engine.add_request(
            "B", SamplingParams(max_tokens=2, structured={"json": {"type": "string", "maxLength": i + 5}})
        )
        for i in range(grammar.COMPILE_THREADS, grammar.COMPILE_THREADS + 3)
    ]
    for request_id in waiting:  # their compiles are queued behind the busy one: cancelled, never run
        engine.abort(request_id)
    _, outputs = _step_gaps(engine, busy)
    assert outputs[busy].error is None
    assert all(outputs[r].outputs[0].finish_reason == "abort" for r in waiting)
    assert calls == ["json"] * grammar.COMPILE_THREADS  # the busy compile (and any that had started) only


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_asking_for_one_constraint_share_its_compile(llm, monkeypatch):
    calls = []
    real = grammar.XGrammarProcessor.compile
    monkeypatch.setattr(grammar.XGrammarProcessor, "compile", lambda self, *a: calls.append(1) or real(self, *a))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    params = SamplingParams(max_tokens=24, temperature=0, structured={"json": schema})
    outputs = llm.generate(["One:", "Two:", "Three:"], params)
    again = llm.generate(["Four:"], params)
    assert all(o.error is None for o in [*outputs, *again])
    assert len(calls) == 1
