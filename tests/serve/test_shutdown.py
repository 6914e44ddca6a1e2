"""Graceful shutdown and engine supervision (issue 43): a live `infer serve` subprocess on loopback gets
SIGTERM with streams open (each ends complete or with an error event, then [DONE]; new requests are
refused; exit code 4; no process left), its engine process killed with -9 (error events, 503s never
400s, /metrics answering, exit code 5) and, with --restart-engine, killed and served again. Then the
pieces in-process: the 503 mapping, a draining app, `end_all`, and /metrics read from published snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from launchers import assert_gone, cmdline, descendants, free_port  # tests/, on sys.path

from infer import LLM, SamplingParams
from infer.serve.app import create_app
from infer.serve.async_engine import AsyncEngine
from infer.serve.engine_thread import EngineDeadError, EngineThread, ShuttingDownError
from infer.serve.errors import api_error
from infer.serve.lifecycle import Lifecycle
from infer.serve.metrics import ServeMetrics
from infer.serve.served import ServedModel
from infer.serve.server import EXIT_CUT, EXIT_ENGINE_DIED, EXIT_OK
from infer.testing.decoder import TINY_LLAMA

MODEL = "t"
LONG, SHORT = 4000, 64  # tokens: a long stream outlasts the shutdown timeout (~3 ms a step), a short one does not
OPTIONS = dict(attention="torch", max_model_len=4096, num_kv_blocks=1400)


@pytest.fixture(scope="module")
def long_chat_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and 4,096 positions: streams long enough to be cut."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("long-chat")
    torch.manual_seed(0)
    config = {**TINY_LLAMA, "vocab_size": 49152, "max_position_embeddings": 4096}
    LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32")).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


# ---------------------------------------------------------------------------- a live `infer serve`


class ServeProcess:
    """`infer serve` over `model_dir` on a free port (its log in `log`), up once /health says ok."""

    def __init__(self, model_dir: Path, log: Path, *flags: str) -> None:
        port = free_port()
        options = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
        command = [sys.executable, "-m", "infer.cli.main", "serve", "--model", f"{model_dir}:name={MODEL}"]
        command += [*options, "--port", str(port), *flags]
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log.open("w") as err:  # a file, not a pipe: the access log never blocks the server
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        self.root = f"http://127.0.0.1:{port}"
        self.wait_healthy(120)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.root}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)

    def tree(self) -> set[int]:
        """The server and every process below it."""
        return {self.process.pid, *descendants(self.process.pid)}

    def engine_pid(self) -> int:
        (pid,) = [p for p in descendants(self.process.pid) if b"spawn_main" in cmdline(p)]
        return pid

    def exit_code(self, timeout_s: float = 30) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the server did not exit: {self.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def serve(long_chat_dir, tmp_path):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(long_chat_dir, tmp_path / f"serve-{len(started)}.log", *flags))
        return started[-1]

    yield start
    for server in started:
        server.stop()


async def read_stream(client: httpx.AsyncClient, root: str, max_tokens: int, started: asyncio.Event) -> list[str]:
    """A greedy stream's events (data: ...), `started` set at the first."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", f"{root}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():  # a cut connection raises here
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                started.set()
    return events


async def post_json(client: httpx.AsyncClient, root: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return await client.post(f"{root}/v1/completions", json=body)


def ending(events: list[str], max_tokens: int) -> str:
    """ "complete" (every token, its usage, [DONE]) or the error code of the event before [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["type"] == "server_error"
        return last["error"]["code"]
    assert last["usage"]["completion_tokens"] == max_tokens
    return "complete"


def error_503(response: httpx.Response, code: str) -> str:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error["message"]


def refused_or_503(root: str, path: str, code: str) -> None:
    try:
        response = httpx.post(f"{root}{path}", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=10)
    except httpx.ConnectError:
        return
    assert "shutting down" in error_503(response, code)


@pytest.mark.slow
def test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_an_error(serve):
    server = serve("--shutdown-timeout", "2")
    tree = server.tree()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            longs = [asyncio.Event() for _ in range(3)]
            plain = asyncio.ensure_future(post_json(client, server.root, LONG))
            tasks = [asyncio.ensure_future(read_stream(client, server.root, LONG, e)) for e in longs]
            await asyncio.gather(*(e.wait() for e in longs))
            shorts = [asyncio.Event() for _ in range(2)]
            tasks += [asyncio.ensure_future(read_stream(client, server.root, SHORT, e)) for e in shorts]
            await asyncio.gather(*(e.wait() for e in shorts))
            server.process.send_signal(signal.SIGTERM)  # every stream is running
            for _ in range(100):  # draining within a tick: /health refuses
                try:
                    health = await client.get(f"{server.root}/health")
                except httpx.ConnectError:
                    break
                if health.status_code == 503:
                    assert "shutting down" in error_503(health, "server_shutting_down")
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("/health stayed ok after SIGTERM")
            await asyncio.to_thread(refused_or_503, server.root, "/v1/completions", "server_shutting_down")
            return await asyncio.gather(*tasks), await plain

    streams, plain = asyncio.run(main())
    outcomes = [ending(events, n) for events, n in zip(streams, [LONG] * 3 + [SHORT] * 2)]
    assert outcomes == ["server_shutting_down"] * 3 + ["complete"] * 2
    assert "shut down" in error_503(plain, "server_shutting_down")  # a JSON request still running: a 503
    assert server.exit_code() == EXIT_CUT
    assert_gone(tree)
    assert "ending the 4 requests still running with an error" in server.log.read_text()


@pytest.mark.slow
def test_a_killed_engine_ends_its_streams_and_the_server_exits(serve):
    server = serve("--shutdown-timeout", "10")
    tree = server.tree()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event() for _ in range(3)]
            plain = asyncio.ensure_future(post_json(client, server.root, LONG))
            tasks = [asyncio.ensure_future(read_stream(client, server.root, LONG, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(server.engine_pid(), signal.SIGKILL)
            return await asyncio.gather(*tasks), await plain

    streams, plain = asyncio.run(main())
    assert "stopped" in error_503(plain, "engine_dead")  # never a 400
    for events in streams:
        assert ending(events, LONG) == "engine_dead"
        assert "the engine stopped" in json.loads(events[-2])["error"]["message"]
    # answered, not refused, for a moment: the reason reaches whoever asks
    assert "stopped" in error_503(httpx.get(f"{server.root}/health"), "engine_dead")
    new = httpx.post(f"{server.root}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert "engine" in error_503(new, "engine_dead") and "stopped" in new.json()["error"]["message"]
    metrics = httpx.get(f"{server.root}/metrics")
    assert metrics.status_code == 200 and f'infer_engine_up{{model="{MODEL}"}} 0.0' in metrics.text
    assert f'infer_kv_cache_blocks{{model="{MODEL}"}}' not in metrics.text  # a dead engine's gauges are left out
    assert server.exit_code() == EXIT_ENGINE_DIED
    assert_gone(tree)


@pytest.mark.slow
def test_with_restart_engine_a_killed_engine_serves_again(serve):
    server = serve("--restart-engine", "--shutdown-timeout", "5")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    before = httpx.post(f"{server.root}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    first_engine = server.engine_pid()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            task = asyncio.ensure_future(read_stream(client, server.root, LONG, started))
            await started.wait()
            os.kill(first_engine, signal.SIGKILL)
            return await task

    assert ending(asyncio.run(main()), LONG) == "engine_dead"
    refused = httpx.post(f"{server.root}/v1/completions", json=body, timeout=30)
    if refused.status_code != 200:  # (the restart may already be done on a fast machine)
        assert "stopped" in error_503(refused, "engine_dead")
    server.wait_healthy(60)
    after = httpx.post(f"{server.root}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    assert after == before
    metrics = httpx.get(f"{server.root}/metrics").text
    assert f'infer_engine_up{{model="{MODEL}"}} 1.0' in metrics
    assert f'infer_engine_restarts_total{{model="{MODEL}"}} 1.0' in metrics
    tree = server.tree()
    assert server.engine_pid() != first_engine
    server.process.send_signal(signal.SIGTERM)  # nothing running: a clean exit
    assert server.exit_code() == EXIT_OK
    assert_gone(tree)


# ---------------------------------------------------------------------------- in-process


def test_a_stopped_engine_or_a_stopping_server_is_a_503():
    for exc, code in ((EngineDeadError("the engine stopped"), "engine_dead"),
                      (ShuttingDownError("shutting down"), "server_shutting_down")):  # fmt: skip
        error = api_error(exc)
        assert (error.status, error.type, error.code) == (503, "server_error", code)
        assert set(error.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_to_a_closed_engine_are_503s_and_metrics_still_answer(tiny_chat_dir, live):
    llm = LLM(model=str(tiny_chat_dir), attention="torch", num_kv_blocks=32, max_model_len=128)
    engine = AsyncEngine(llm.engine)
    server = live(create_app({MODEL: engine}))
    engine.close()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for stream in (False, True):
        new = httpx.post(f"{server.url}/completions", json={**body, "stream": stream})
        assert "closed" in error_503(new, "engine_dead")
    assert "stopped" in error_503(httpx.get(f"{server.root}/health"), "engine_dead")
    metrics = httpx.get(f"{server.root}/metrics")
    assert metrics.status_code == 200 and f'infer_engine_up{{model="{MODEL}"}} 0.0' in metrics.text


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_draining_app_refuses_new_requests_but_not_metrics(tiny, live):
    lifecycle = Lifecycle()
    server = live(create_app({MODEL: tiny.engine}, lifecycle=lifecycle))
    assert httpx.get(f"{server.root}/health").status_code == 200
    # the answer reaches the client before the server's middleware counts it done (a loaded machine may
    # run this thread first): wait for the count, with no bound on how late it comes but the test's
    deadline = time.monotonic() + 30
    while lifecycle.num_active:
        assert time.monotonic() < deadline, "the health check was never counted done"
        time.sleep(0.01)
    lifecycle.stop_accepting("the server is shutting down: retry elsewhere")
    for response in (
        httpx.post(f"{server.url}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        httpx.get(f"{server.root}/health"),
    ):
        assert "shutting down" in error_503(response, "server_shutting_down")
        assert response.headers["connection"] == "close"
    assert httpx.get(f"{server.root}/metrics").status_code == 200
    assert lifecycle.num_active == 0  # refused and /metrics: never counted


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_snapshots_are_published_at_most_every_interval_and_end_all_ends_streams(long_chat_dir):
    llm = LLM(model=str(long_chat_dir), attention="torch", num_kv_blocks=256, max_model_len=4096)
    published: list = []
    thread = EngineThread(llm.engine, publish=published.append, snapshot_interval_s=0.2)
    engine = AsyncEngine(llm.engine, thread=thread)

    async def generate_then_cut():
        started = time.monotonic()
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=600, ignore_eos=True))]
        took = time.monotonic() - started
        stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True))
        await anext(stream)
        engine.end_all(ShuttingDownError("the server shut down"))
        with pytest.raises(ShuttingDownError):
            await anext(stream)
        with pytest.raises(ShuttingDownError):  # and so is every new request
            engine.submit([5, 6, 7], SamplingParams(max_tokens=2))
        return outs, took

    try:
        outs, took = asyncio.run(generate_then_cut())
        assert outs[-1].finished
        assert 1 <= len(published) <= took / 0.2 + 3  # busy: at most every 0.2 s (and once idle)
        deadline = time.monotonic() + 10
        while engine.snapshot.num_running or engine.snapshot.kv_usage:  # the cut request was aborted
            assert time.monotonic() < deadline, engine.snapshot
            time.sleep(0.05)
    finally:
        engine.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_scrape_reads_the_published_snapshot_and_never_calls_the_engine(tiny, monkeypatch):
    metrics = ServeMetrics([ServedModel(MODEL, tiny.engine)])

    def no_calls(fn):
        raise AssertionError("a scrape called into the engine")

    async def one_request():
        return [o async for o in tiny.engine.generate([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))]

    steps_before = tiny.engine.snapshot.stats.get("steps", 0)
    asyncio.run(one_request())
    monkeypatch.setattr(tiny.engine, "call", no_calls)
    text = metrics.scrape().decode()
    snap = tiny.engine.snapshot  # published when the engine went idle, before the last output left
    assert snap.num_running == 0 and snap.stats["steps"] > steps_before
    assert f'infer_engine_steps_total{{model="{MODEL}"}} {float(snap.stats["steps"])}' in text
    assert f'infer_num_requests_running{{model="{MODEL}"}} 0.0' in text
    assert f'infer_engine_up{{model="{MODEL}"}} 1.0' in text
