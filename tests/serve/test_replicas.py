"""Data parallelism (`infer serve --data-parallel-size N`): replicas behind a prefix-aware, least-loaded
router. The router's choices on their own; replicas in threads giving a single engine's greedy tokens,
prefix routing's cache hits measured against load alone; spawned replicas behind a live server, one killed
under load: every accepted request still finishes, with the tokens it would have had, and the router
sends nothing more to the dead one."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer import LLM, SamplingParams
from infer.api.config import EngineConfig
from infer.serve.app import create_app
from infer.serve.async_engine import AsyncEngine, build_engine
from infer.serve.engine_thread import EngineDeadError
from infer.serve.replicas import PrefixRouter, ReplicatedEngine, RoutedStream

OPTIONS = dict(attention="torch", num_kv_blocks=128, max_model_len=256)
MAX_TOKENS = 160


def prefix(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_the_router_sends_a_prefix_to_its_holder_else_to_the_least_loaded():
    router = PrefixRouter(3, block_size=4)
    system = prefix(16, 1)
    first = router.pick(system + [7, 8], [0, 0, 0])
    assert router.load_routed == 1
    # the same 16-token prefix: 16 of 18 tokens held by `first`, whatever the others' load
    loads = [0.0, 0.0, 0.0]
    loads[first] = 3.0
    assert router.pick(system + [9, 9], loads) == first and router.prefix_routed == 1
    # a new prompt: the least loaded; equal loads taken in turn
    other = router.pick(prefix(18, 2), loads)
    assert other != first and loads[other] == 0.0
    # too little of it held (4 of 18 tokens < half): the least loaded
    assert router.pick(system[:4] + prefix(14, 3), [0.0 if i != first else 5.0 for i in range(3)]) != first
    # out of balance (12 over the idlest and over 1.5x): load wins over the prefix
    unbalanced = [0.0, 0.0, 0.0]
    unbalanced[first] = 12.0
    assert router.pick(system + [1, 2], unbalanced) != first
    # a holder that is down is passed over; none up: the request cannot run
    down: list[float | None] = [0.0, 0.0, 0.0]
    down[first] = None
    assert router.pick(system + [3, 4], down) != first
    with pytest.raises(EngineDeadError, match="every replica of this model stopped"):
        router.pick(system, [None, None, None])


def test_the_router_forgets_the_oldest_prefixes_and_a_restarted_replicas():
    router = PrefixRouter(2, block_size=2, capacity=4)
    router.record([1, 2, 3, 4], 0)
    router.record([5, 6, 7, 8], 1)
    assert router.match([1, 2, 3, 4], [True, True]) == (0, 4)
    router.record([9, 9, 9, 9], 1)  # 6 blocks over a capacity of 4: [1, 2, 3, 4]'s are gone
    assert router.match([1, 2, 3, 4], [True, True]) == (None, 0)
    assert router.match([5, 6, 7, 8], [True, True]) == (1, 4)
    router.forget(1)
    assert router.match([5, 6, 7, 8], [True, True]) == (None, 0)


@pytest.fixture(scope="module")
def in_threads(tiny_chat_dir):
    """Two replicas stepped by threads of this process (a router's behaviour without processes)."""
    llms = [LLM(model=str(tiny_chat_dir), enable_prefix_caching=True, **OPTIONS) for _ in range(2)]
    engine = ReplicatedEngine([AsyncEngine(llm.engine) for llm in llms])
    yield engine, llms
    engine.close()


async def _tokens(engine, prompts, params) -> list[list[int]]:
    async def one(p):
        stream = engine.submit({"prompt_token_ids": p}, params)
        assert isinstance(stream, RoutedStream)
        outs = [out async for out in stream]
        return outs[-1].final.outputs[0].token_ids

    return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_replicas_give_a_single_engines_greedy_tokens(in_threads, tiny_chat_dir):
    engine, _ = in_threads
    prompts = [prefix(10 + i, 100 + i) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(model=str(tiny_chat_dir), **OPTIONS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert asyncio.run(_tokens(engine, prompts, params)) == expected
    routed = [state.routed for state in engine.replica_states()]
    assert min(routed) >= 3  # spread: 8 requests at once over 2 replicas
    snap = engine.snapshot
    assert snap.num_kv_blocks == 2 * 128 and snap.num_running == 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_prefix_routing_finds_more_of_the_cache_than_load_alone(tiny_chat_dir):
    """A shared-prefix workload: 8 system prompts of 64 tokens (4 blocks), each asked 6 times with its own
    8-token question, 4 requests at a time in a shuffled order, on replicas of 28 KV blocks each (room for
    about half the system prompts beside the running requests). The prefix cache's hit rate over both
    replicas, routed by prefix, then by load alone (a threshold never met)."""
    systems = [prefix(64, s) for s in range(8)]
    asks = [systems[s] + prefix(8, 1000 * r + s) for r in range(6) for s in range(8)]
    random.Random(0).shuffle(asks)
    batches = [asks[i : i + 4] for i in range(0, len(asks), 4)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    options = OPTIONS | {"num_kv_blocks": 28}

    def hit_rate(cache_threshold: float) -> float:
        llms = [LLM(model=str(tiny_chat_dir), enable_prefix_caching=True, **options) for _ in range(2)]
        router = PrefixRouter(2, block_size=16, cache_threshold=cache_threshold)
        engine = ReplicatedEngine([AsyncEngine(llm.engine) for llm in llms], router)
        try:
            for prompts in batches:
                asyncio.run(_tokens(engine, prompts, params))
            snap = engine.snapshot
            return snap.prefix_hit_tokens / snap.prefix_query_tokens
        finally:
            engine.close()
            for llm in llms:
                llm.close()

    by_prefix, by_load = hit_rate(0.5), hit_rate(2.0)
    print(f"prefix-cache hit rate: by prefix {by_prefix:.3f}, by load alone {by_load:.3f}")
    # by prefix each system prompt is computed once (its first ask) and found in the other 5 (64 of 72 tokens)
    assert by_prefix >= 0.9 * (5 / 6) * (64 / 72)
    assert by_prefix > by_load + 0.1


@pytest.fixture
def two_spawned(tiny_chat_dir):
    config = EngineConfig().replace(model=str(tiny_chat_dir), **OPTIONS)
    engine = ReplicatedEngine.spawn(functools.partial(build_engine, config), 2)
    yield engine
    engine.close()


def _metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.root}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _greedy(model_dir, prompts, max_tokens: int) -> list[list[int]]:
    with LLM(model=str(model_dir), **OPTIONS) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def kill_one_under_load(engine: ReplicatedEngine, server, prompts, max_tokens: int, kill_after: int) -> list[list[int]]:
    """Every prompt at once through the official client (even ones streamed, odd ones not), greedy, token ids
    back; replica 0's process SIGKILLed once `kill_after` tokens were streamed and it has requests open."""
    victim_pid = engine.replicas[0]._thread._process.pid
    streamed = [0]

    async def load():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:

            async def one(i: int, stream: bool):
                kwargs = dict(model="m", prompt=prompts[i], max_tokens=max_tokens, temperature=0, logprobs=0)
                extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
                if not stream:
                    answer = await client.completions.create(**kwargs, extra_body=extra)
                    return [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
                tokens = []
                async for chunk in await client.completions.create(**kwargs, extra_body=extra, stream=True):
                    if chunk.choices and chunk.choices[0].logprobs:
                        tokens += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
                        streamed[0] += len(chunk.choices[0].logprobs.tokens)
                return tokens

            async def kill_when_busy():  # mid-run: streams have tokens out, and replica 0 has requests open
                deadline = time.monotonic() + 120
                while streamed[0] < kill_after or engine.replica_states()[0].open_requests < 2:
                    assert time.monotonic() < deadline, "replica 0 never got busy"
                    await asyncio.sleep(0.005)
                os.kill(victim_pid, signal.SIGKILL)

            killer = asyncio.ensure_future(kill_when_busy())
            got = await asyncio.gather(*(one(i, stream=i % 2 == 0) for i in range(len(prompts))))
            await killer
            return got

    return asyncio.run(load())


def check_the_dead_replica_is_left_alone(engine: ReplicatedEngine, server, prompts) -> None:
    assert not engine.replicas[0].is_alive and engine.is_alive
    assert engine.num_retries >= 1 and engine.num_continued >= 1  # some went on mid-answer
    before = engine.replica_states()[0].routed
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
        for p in prompts[:4]:
            client.completions.create(model="m", prompt=p, max_tokens=2)
    states = engine.replica_states()
    assert states[0].routed == before and not states[0].alive  # nothing more to the dead one
    assert [state.open_requests for state in states] == [0, 0]  # every request uncounted once it ended
    metrics = _metrics(server)
    assert metrics[("infer_replica_up", (("model", "m"), ("replica", "0")))] == 0.0
    assert metrics[("infer_replica_up", (("model", "m"), ("replica", "1")))] == 1.0
    assert metrics[("infer_router_retries_total", (("model", "m"),))] == engine.num_retries
    assert metrics[("infer_engine_up", (("model", "m"),))] == 1.0
    assert httpx.get(f"{server.root}/health").status_code == 200


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_replica_killed_under_load_loses_no_request(two_spawned, tiny_chat_dir, live):
    prompts = [prefix(12, 300 + i) for i in range(12)]
    expected = _greedy(tiny_chat_dir, prompts, MAX_TOKENS)
    server = live(create_app({"m": two_spawned}))
    got = kill_one_under_load(two_spawned, server, prompts, MAX_TOKENS, kill_after=30)
    assert got == expected  # every accepted request finished, with the tokens it would have had
    check_the_dead_replica_is_left_alone(two_spawned, server, prompts)


@pytest.fixture(scope="module")
def local_ray():
    """A Ray cluster of this machine alone, on loopback, for the module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_ray_places_two_smollm2_replicas_behind_one_server(local_ray, smollm2_dir, live):
    from infer.serve.ray_executor import RayProcess, RayStarter

    config = EngineConfig().replace(model=str(smollm2_dir), attention="torch", num_kv_blocks=96, max_model_len=256)
    engine = ReplicatedEngine.spawn(functools.partial(build_engine, config), 2, start=RayStarter())
    try:
        processes = [r._thread._process for r in engine.replicas]
        assert all(isinstance(p, RayProcess) for p in processes)
        assert len({p.pid for p in processes} | {os.getpid()}) == 3  # two actors, neither this process
        texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are"]
        with LLM(model=str(smollm2_dir), attention="torch", max_model_len=256) as llm:
            tokenizer = llm.tokenizer
            prompts = [tokenizer(t)["input_ids"] for t in texts] * 2
            params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
            expected = [
                o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            ]
        server = live(create_app({"m": engine}))
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0) as client:
            plain = client.completions.create(model="m", prompt=texts[0], max_tokens=8, temperature=0)
        assert plain.choices[0].text == tokenizer.decode(expected[0][:8])
        got = kill_one_under_load(engine, server, prompts, 48, kill_after=16)
        assert got == expected
        check_the_dead_replica_is_left_alone(engine, server, prompts)
    finally:
        engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_an_ended_replicated_engine_refuses_and_retries_nothing(tiny_chat_dir):
    from infer.serve.engine_thread import ShuttingDownError

    llms = [LLM(model=str(tiny_chat_dir), **OPTIONS) for _ in range(2)]
    engine = ReplicatedEngine([AsyncEngine(llm.engine) for llm in llms])
    stop = ShuttingDownError("the server is shutting down: retry the request on another server")

    async def main():
        stream = engine.submit({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=100, ignore_eos=True))
        engine.end_all(stop)
        with pytest.raises(ShuttingDownError):
            async for _ in stream:
                pass
        assert stream.retries == 0 and engine.num_retries == 0
        with pytest.raises(ShuttingDownError):
            engine.submit({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))

    try:
        asyncio.run(main())
    finally:
        engine.close()
        for llm in llms:
            llm.close()
