"""The public stepping API as an app meets it (the README's example runs in tests/test_readme.py): the
streamed pieces of several requests, n > 1 and a stop string included, add up to exactly what
`generate` returns for them."""

from __future__ import annotations

import pytest

from infer import EngineConfig, SamplingParams, make_engine
from infer.api.errors import RequestError


def test_streamed_pieces_add_up_to_generates_outputs(tiny_llama_dir):
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=["e"]),
    ]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    config = EngineConfig(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    engine = make_engine(config)
    try:
        expected = engine.generate(prompts, params)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        for request_id in ids:
            engine.stream(request_id)
        with pytest.raises(RequestError, match="no unfinished request"):
            engine.stream("no-such-request")
        texts = {(i, k): "" for i in ids for k in range(2)}
        tokens: dict[tuple[str, int], list[int]] = {key: [] for key in texts}
        outputs = {}
        while engine.has_unfinished():
            step = engine.step_outputs()
            for request_id, deltas in step.news:
                for index, text, token_ids, _ in deltas:
                    texts[request_id, index] += text
                    tokens[request_id, index] += token_ids
            for output, last in step.finished:
                outputs[output.request_id] = output
                for delta in last.deltas:
                    texts[output.request_id, delta.index] += delta.text
                    tokens[output.request_id, delta.index] += delta.token_ids
        for request_id, want in zip(ids, expected):
            got = outputs[request_id]
            for sample, want_sample in zip(got.outputs, want.outputs):
                assert texts[request_id, sample.index] == sample.text == want_sample.text
                assert tokens[request_id, sample.index] == sample.token_ids == want_sample.token_ids
        assert not engine.is_generating(ids[0])  # finished (and unknown alike)
    finally:
        engine.close()


def test_streaming_twice_step_and_abandon_all_leave_nothing_behind(tiny_llama_dir):
    """A second `stream()` of a request changes nothing (no piece sent twice); a streamed request that
    `step()` ends, and every request `abandon_all()` drops, leave no stream state behind."""
    config = EngineConfig(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    engine = make_engine(config)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        request_id = engine.add_request([5, 6, 7], params)
        engine.stream(request_id)
        tokens: list[int] = []
        for _ in range(3):
            tokens += [t for _, deltas in engine.step_outputs().news for _, _, ids, _ in deltas for t in ids]
        engine.stream(request_id)  # again, mid-stream
        final = None
        while engine.has_unfinished():
            step = engine.step_outputs()
            tokens += [t for _, deltas in step.news for _, _, ids, _ in deltas for t in ids]
            for output, last in step.finished:
                final, tokens = output, tokens + last.deltas[0].token_ids
        assert final is not None and tokens == final.outputs[0].token_ids

        engine.stream(engine.add_request([5, 6, 7], params))
        while engine.has_unfinished():
            engine.step()  # the plain loop: the stream's news is dropped, its state too
        assert not engine._streams.tracked and not engine._streams.samples

        engine.stream(engine.add_request([5, 6, 7], params))
        engine.step_outputs()
        engine.abandon_all()
        assert not engine.has_unfinished() and not engine._streams.tracked and not engine._streams.samples
    finally:
        engine.close()
