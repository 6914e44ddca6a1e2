"""An engine built and stepped in a process of its own (what `infer serve` runs): the official client's
streamed and plain completions equal LLM.generate's, a client that leaves frees its blocks, a model
that cannot be built is refused with its own error, and a process that dies ends its streams."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading

import httpx
import openai
import pytest

from infer import LLM, SamplingParams
from infer.api.config import EngineConfig
from infer.api.errors import InferError, RequestError
from infer.serve.app import create_app
from infer.serve.async_engine import AsyncEngine, build_engine
from infer.serve.engine_thread import EngineDeadError
from infer.serve.served import snapshot

PROMPTS = ["The capital of France is", "Once upon a time"]
OPTIONS = dict(attention="torch", num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def spawned(tiny_chat_dir):
    config = EngineConfig().replace(model=str(tiny_chat_dir), **OPTIONS)
    engine = AsyncEngine.spawn(functools.partial(build_engine, config))
    yield engine
    engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_completions_equal_the_offline_output(spawned, tiny_chat_dir, live):
    params = SamplingParams(max_tokens=12, temperature=0)
    with LLM(model=str(tiny_chat_dir), **OPTIONS) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    server = live(create_app({"tiny": spawned}))
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
        for prompt, text in zip(PROMPTS, expected):
            plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
            assert plain.choices[0].text == text
            assert "".join(c.choices[0].text for c in stream if c.choices) == text


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_reader_that_leaves_frees_its_blocks(spawned):
    async def leave_early():
        async for out in spawned.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
            if sum(len(d.token_ids) for d in out.deltas):
                break  # the stream closes: the request is aborted

    async def state():
        return await spawned.call(snapshot)

    asyncio.run(leave_early())
    after = asyncio.run(state())
    assert (after.num_running, after.num_waiting, after.kv_usage) == (0, 0, 0.0)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_model_that_cannot_be_built_is_refused_with_its_error(tmp_path):
    config = EngineConfig().replace(model=str(tmp_path / "no-such-model"), **OPTIONS)
    with pytest.raises(InferError, match="no-such-model does not exist"):
        AsyncEngine.spawn(functools.partial(build_engine, config))


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_dead_process_ends_its_streams(tiny_chat_dir):
    config = EngineConfig().replace(model=str(tiny_chat_dir), **OPTIONS)
    engine = AsyncEngine.spawn(functools.partial(build_engine, config))
    try:

        async def read():
            stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
            os.kill(engine._thread._process.pid, signal.SIGKILL)
            return [out async for out in stream]

        with pytest.raises(EngineDeadError, match="process ended, killed by signal 9"):
            asyncio.run(read())
        assert not engine.is_alive

        async def more():
            return engine.submit([5, 6, 7], SamplingParams(max_tokens=4))

        with pytest.raises(EngineDeadError, match="the engine stopped"):  # a new request too: not a RequestError
            asyncio.run(more())
    finally:
        engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_health_says_so_when_the_process_is_gone(tiny_chat_dir, live):
    config = EngineConfig().replace(model=str(tiny_chat_dir), **OPTIONS)
    engine = AsyncEngine.spawn(functools.partial(build_engine, config))
    try:
        server = live(create_app({"tiny": engine}))
        assert httpx.get(f"{server.root}/health").status_code == 200
        os.kill(engine._thread._process.pid, signal.SIGKILL)
        engine._thread._process.join(10)
        assert httpx.get(f"{server.root}/health").status_code == 503
    finally:
        engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_cancelled_call_leaves_the_engine_serving(spawned):
    async def main():
        waiting = asyncio.ensure_future(spawned.call(snapshot))
        await asyncio.sleep(0)  # the call is sent
        waiting.cancel()  # its caller gives up before the answer comes back
        with pytest.raises(asyncio.CancelledError):
            await waiting
        after = await spawned.call(snapshot)  # the reader thread still answers
        outs = [out async for out in spawned.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
        return after, outs

    after, outs = asyncio.run(main())
    assert after.num_running == 0 and outs[-1].finished and spawned.is_alive


def _unpicklable(engine):
    return threading.Lock()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_result_that_cannot_cross_fails_only_its_call(spawned):
    async def main():
        with pytest.raises(RequestError, match="cannot leave the engine's process"):
            await spawned.call(_unpicklable)
        return await spawned.call(snapshot)

    assert asyncio.run(main()).num_running == 0 and spawned.is_alive


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_reused_request_id_gets_its_own_outputs(spawned):
    async def main():
        first = spawned.submit([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="same")
        first.close()  # aborted: its last output may still be on its way
        for _ in range(100):  # the engine refuses the id until it has ended the first request
            try:
                params = SamplingParams(max_tokens=6, ignore_eos=True)
                return [o async for o in spawned.generate([5, 6, 7], params, "same")]
            except RequestError as exc:
                assert "already in use" in str(exc)
                await asyncio.sleep(0.05)
        raise AssertionError("the first request with this id never ended")

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].final.outputs[0].finish_reason == "length"
    assert sum(len(d.token_ids) for o in outs for d in o.deltas) == 6
