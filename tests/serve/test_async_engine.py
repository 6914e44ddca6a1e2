"""AsyncEngine: streamed deltas add up to the request's final output exactly, and that is LLM.generate's
(its logprobs up to float32 rounding); a reader that leaves aborts its request and frees its blocks; bad
input, a full queue and a failing step stay with their requests."""

from __future__ import annotations

import asyncio

import pytest

from infer import LLM, SamplingParams
from infer.api.errors import RequestError
from infer.serve.async_engine import AsyncEngine, QueueFullError
from infer.serve.engine_thread import EngineStepError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colours:"]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0),
    SamplingParams(max_tokens=24, temperature=0, stop=["\n\n", "return"]),  # a stop string cuts text and tokens
    SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2, logprobs=3),
    SamplingParams(max_tokens=20, temperature=0, stop=["green", "answer"], logprobs=0),
]


@pytest.fixture(scope="module")
def served(smol):
    """(the AsyncEngine, LLM.generate's outputs for PROMPTS/PARAMS, run on the engine's thread while idle)."""
    return smol.engine, smol.offline(lambda llm: llm.generate(PROMPTS, PARAMS))


async def _collect(engine, prompt, params, **kw):
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    outs = []
    async for out in engine.generate(prompt, params, **kw):
        outs.append(out)
        for d in out.deltas:
            texts[d.index] = texts.get(d.index, "") + d.text
            tokens.setdefault(d.index, []).extend(d.token_ids)
            logprobs.setdefault(d.index, []).extend(d.logprobs or [])
    return outs, texts, tokens, logprobs


async def _read(stream):
    return [out async for out in stream]


def _used_blocks(engine):
    return engine.call(lambda e: (e.kv_usage().num_used_blocks, e.has_unfinished()))


def _assert_close_logprobs(got, expected, atol=1e-3):
    """The same top tokens at each position, their logprobs within float32 rounding: requests that arrive
    over several steps share batches other than LLM.generate's, and the CPU's matrix products may round a
    row differently in another batch (seen: up to 1.5e-5, growing along the output)."""
    assert (got is None) == (expected is None)
    for g, e in zip(got or [], expected or [], strict=True):
        assert g.keys() == e.keys()
        assert max(abs(g[t] - e[t]) for t in e) < atol, (g, e)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_streamed_deltas_add_up_to_the_offline_output(served):
    engine, expected = served

    async def main():
        return await asyncio.gather(*(_collect(engine, p, s) for p, s in zip(PROMPTS, PARAMS)))

    for (outs, texts, tokens, logprobs), ref in zip(asyncio.run(main()), expected):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = outs[-1].final
        assert final.prompt == ref.prompt and final.prompt_token_ids == ref.prompt_token_ids
        for c, f in zip(ref.outputs, final.outputs):
            assert (f.text, f.token_ids, f.finish_reason) == (c.text, c.token_ids, c.finish_reason)
            assert texts[c.index] == c.text and tokens[c.index] == c.token_ids
            assert logprobs[c.index] == (f.logprobs or [])  # the deltas add up to the final output, exactly
            _assert_close_logprobs(f.logprobs, c.logprobs)
        assert len(outs) > 2  # streamed step by step, not all at the end


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_reader_that_leaves_aborts_and_frees_blocks(served):
    engine, expected = served
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def main():
        stream = engine.submit("Tell me a long story.", long)
        other = asyncio.create_task(_collect(engine, PROMPTS[0], PARAMS[0]))
        async for out in stream:
            if any(d.token_ids for d in out.deltas):
                break
        assert (await _used_blocks(engine))[0] > 0
        await stream.aclose()
        # the abort was queued before this call, so it ran first: only the other request holds blocks
        held = await engine.call(lambda e: (e.kv_usage().num_used_blocks, _blocks_of_unfinished(e)))
        return held, await other, await _used_blocks(engine)

    (used, of_others), (outs, texts, tokens, _), (used_at_end, unfinished) = asyncio.run(main())
    assert used == of_others
    assert tokens[0] == expected[0].outputs[0].token_ids and texts[0] == expected[0].outputs[0].text
    assert used_at_end == 0 and not unfinished


def _blocks_of_unfinished(engine):
    return len({b for r in engine.requests.values() if not r.is_finished for b in r.block_ids})


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_abort_by_id_ends_the_stream_with_reason_abort(served):
    engine, _ = served

    async def main():
        stream = engine.submit("Count to a thousand:", SamplingParams(max_tokens=300, ignore_eos=True), "mine")
        first = await stream.__anext__()
        await engine.abort("mine")
        rest = [out async for out in stream]
        return first, rest, await _used_blocks(engine)

    first, rest, (used, unfinished) = asyncio.run(main())
    assert rest[-1].finished and rest[-1].final.outputs[0].finish_reason == "abort"
    assert used == 0 and not unfinished


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_input_raises_before_the_first_output_and_others_run(served):
    engine, expected = served

    async def main():
        good = asyncio.create_task(_collect(engine, PROMPTS[0], PARAMS[0]))
        errors = []
        for prompt, params in [("", PARAMS[0]), ("hi", SamplingParams(max_tokens=1, logprobs=10**9))]:
            with pytest.raises(RequestError) as info:
                async for _ in engine.generate(prompt, params):
                    pass
            errors.append(str(info.value))
        with pytest.raises(RequestError, match="in use"):
            engine.submit("hi", PARAMS[0], request_id="twice")
            engine.submit("hi", PARAMS[0], request_id="twice")
        return errors, await good

    errors, (_, texts, tokens, _) = asyncio.run(main())
    assert "empty prompt" in errors[0] and "logprobs" in errors[1]
    assert tokens[0] == expected[0].outputs[0].token_ids and texts[0] == expected[0].outputs[0].text


def test_a_full_waiting_queue_refuses_with_a_typed_error(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    engine = AsyncEngine(llm.engine, max_waiting=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        streams = [engine.submit([5, 6, 7], params), engine.submit([8, 9], params)]
        with pytest.raises(QueueFullError, match="max_waiting"):
            engine.submit([10, 11], params)
        outs = [await _read(s) for s in streams]
        later = [o async for o in engine.generate([10, 11], params)]  # room again once they started
        return outs, later

    try:
        outs, later = asyncio.run(main())
    finally:
        engine.close()
    assert all(len(o[-1].final.outputs[0].token_ids) == 4 for o in outs) and later[-1].finished
    assert engine.num_waiting == 0


def test_a_failing_step_ends_its_requests_and_the_engine_serves_on(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    engine = AsyncEngine(llm.engine)
    decoder = llm.engine.decoder
    execute = decoder.execute
    calls = []

    def fail_once(out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded")
        return execute(out)

    async def main():
        decoder.execute = fail_once
        with pytest.raises(EngineStepError, match="kernel exploded"):
            async for _ in engine.generate([5, 6, 7], params):
                pass
        del decoder.execute
        after = [o async for o in engine.generate([5, 6, 7], params)]
        return after, await _used_blocks(engine)

    try:
        after, (used, unfinished) = asyncio.run(main())
    finally:
        engine.close()
    assert after[-1].final.outputs[0].token_ids == expected
    assert used == 0 and not unfinished


def test_a_failure_in_the_threads_own_work_is_survived_too(tiny_llama_dir, monkeypatch):
    from infer.core.stream import Tracked

    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    delta = Tracked.delta

    def broken(*args):
        raise KeyError("a bug while cutting deltas")

    async def main():
        monkeypatch.setattr(Tracked, "delta", broken)
        with pytest.raises(EngineStepError, match="a bug while cutting deltas"):
            async for _ in engine.generate([5, 6, 7], params):
                pass
        monkeypatch.setattr(Tracked, "delta", delta)
        after = [o async for o in engine.generate([5, 6, 7], params)]
        return after, await _used_blocks(engine)

    try:
        after, (used, unfinished) = asyncio.run(main())
    finally:
        engine.close()
    assert len(after[-1].final.outputs[0].token_ids) == 6 and engine.engine.closed
    assert used == 0 and not unfinished


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_reader_that_falls_behind_gets_the_missed_steps_as_one_output(served):
    engine, expected = served

    async def main():
        outs = []
        async for out in engine.generate(PROMPTS[0], PARAMS[0]):
            outs.append(out)
            await asyncio.sleep(0.3)  # slower than the engine's steps: deltas pile up in the stream
        return outs

    outs = asyncio.run(main())
    ref = expected[0].outputs[0]
    assert len(outs) < len(ref.token_ids)  # fewer outputs than tokens: steps were merged
    assert "".join(d.text for o in outs for d in o.deltas) == ref.text
    assert [t for o in outs for d in o.deltas for t in d.token_ids] == ref.token_ids
    assert outs[-1].finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
