"""`infer serve --api-server-count N` (issue 45): N API server processes on one port in front of one engine
process, as users meet it: a live server on loopback driven by the official `openai` client and httpx.

Greedy answers equal `LLM`'s whichever front takes them; /metrics sums every front's counts; a response
stored by one front is found through another; a front killed with -9 under load loses only its own
connections (the engine aborts its requests, a new front takes its place, the others' streams finish);
SIGTERM drains every front (exit 0, no process left); an engine killed with -9 stops the server with exit
code 5; what the fronts cannot do yet is refused before a model loads."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from launchers import alive, assert_gone, cmdline, descendants, free_port  # tests/, on sys.path

from infer import LLM, SamplingParams

MODEL = "t"
OPTIONS = ["--attention=torch", "--max-model-len=256", "--num-kv-blocks=256"]
PROMPTS = [f"Story {i}: once upon a time" for i in range(12)]
MAX_TOKENS = 12


class Fronts:
    """`infer serve --api-server-count 2` over `model_dir` on a free port, up once /health says ok."""

    def __init__(self, model_dir: Path, log: Path, *flags: str, count: int = 2) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "infer.cli.main", "serve", "--model", f"{model_dir}:name={MODEL}", *OPTIONS]
        command += ["--port", str(self.port), "--api-server-count", str(count), *flags]
        self.log = log
        with log.open("w") as err:  # a file, not a pipe: the access log never blocks the server
            self.process = subprocess.Popen(
                command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=err
            )
        self.root = f"http://127.0.0.1:{self.port}"
        self.wait_fronts(count, 180)

    def fronts(self) -> list[int]:
        """The pids of the API server processes serving now (uvicorn says each one's start and end)."""
        text = self.log.read_text()
        started = re.findall(r"Started server process \[(\d+)\]", text)
        ended = set(re.findall(r"Finished server process \[(\d+)\]", text))
        return [int(p) for p in started if p not in ended and alive(int(p))]

    def wait_fronts(self, count: int, timeout_s: float, besides: set[int] = frozenset()) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while len(fronts := [p for p in self.fronts() if p not in besides]) < count:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{count} API servers did not start: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        assert httpx.get(f"{self.root}/health", timeout=10).status_code == 200
        return fronts

    def tree(self) -> set[int]:
        return {self.process.pid, *descendants(self.process.pid)}

    def engine_pid(self) -> int:
        """The engine's process: the spawned child that is neither a front nor the response store's manager (the
        one with torch's threads: the most memory)."""
        spawned = [p for p in descendants(self.process.pid) if b"spawn_main" in cmdline(p)]
        return max((p for p in spawned if p not in self.fronts()), key=_rss)

    def exit_code(self, timeout_s: float = 60) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the server did not exit: {self.log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        below = descendants(self.process.pid)  # before its end: then they belong to init
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for pid in below:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fronts(tiny_chat_dir, tmp_path_factory):
    server = Fronts(tiny_chat_dir, tmp_path_factory.mktemp("fronts") / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(tiny_chat_dir) -> list[str]:
    llm = LLM(model=str(tiny_chat_dir), attention="torch", max_model_len=256, num_kv_blocks=256)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


async def _complete_each(root: str, prompts: list[str]) -> list[str]:
    """Each prompt on a connection of its own (the kernel gives each connection to one front), concurrently."""

    async def one(prompt: str) -> str:
        async with openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0) as client:
            out = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return out.choices[0].text

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _finished(root: str) -> float:
    text = httpx.get(f"{root}/metrics", timeout=10).text
    return float(re.search(rf'^infer_requests_total{{model="{MODEL}",outcome="finished"}} (\S+)$', text, re.M)[1])


def test_fronts_answer_as_llm_and_sum_their_metrics(fronts, expected):
    pids = fronts.fronts()
    assert len(pids) == 2 and fronts.process.pid not in pids
    before = _finished(fronts.root)
    got = asyncio.run(_complete_each(fronts.root, PROMPTS))
    assert got == expected
    # every scrape, whichever front answers it, counts every front's requests
    assert {_finished(fronts.root) for _ in range(6)} == {before + len(PROMPTS)}


def test_a_stored_response_is_found_through_every_front(fronts):
    for i in range(6):  # a client each: a new connection, to either front
        with openai.OpenAI(base_url=f"{fronts.root}/v1", api_key="unused", max_retries=0) as client:
            first = client.responses.create(model=MODEL, input=f"Say {i}", max_output_tokens=4, temperature=0)
        with openai.OpenAI(base_url=f"{fronts.root}/v1", api_key="unused", max_retries=0) as client:
            follow = client.responses.create(
                model=MODEL, input="And again", previous_response_id=first.id, max_output_tokens=4, temperature=0
            )
            # found (an unknown previous_response_id is a 404): it ran to its token limit
            assert follow.status == "incomplete" and follow.incomplete_details.reason == "max_output_tokens"
            assert client.responses.retrieve(first.id).id == first.id


def test_a_killed_front_loses_only_its_connections(fronts, expected):
    """Streams on both fronts, one front killed with -9: the other's streams finish with every token, the
    engine aborts the dead front's requests (nothing left running), and a new front serves."""
    before = set(fronts.fronts())

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> str:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        events: list[str] = []
        try:
            async with client.stream("POST", f"{fronts.root}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.HTTPError:
            return "cut"
        return "complete" if events[-1] == "[DONE]" and '"completion_tokens":200' in events[-2] else "short"

    async def run() -> tuple[list[int], list[str]]:
        """Streams started one at a time, each on a connection of its own, until each front holds two; the
        front that took each one is the one whose established connections grew."""
        clients, tasks, owners = [], [], []
        while min(owners.count(p) for p in before) < 2:
            assert len(clients) < 40, f"the kernel gave 40 connections to one front: {owners}"
            held = {p: _connections(p, fronts.port) for p in before}
            clients.append(httpx.AsyncClient(timeout=120))
            started = asyncio.Event()
            tasks.append(asyncio.create_task(stream(clients[-1], started)))
            await asyncio.wait_for(started.wait(), 60)
            (owner,) = [p for p in before if _connections(p, fronts.port) > held[p]]
            owners.append(owner)
        os.kill(owners[-1], signal.SIGKILL)  # the front that took the newest stream: that one is surely running
        endings = await asyncio.gather(*tasks)
        for c in clients:
            await c.aclose()
        return owners, endings

    owners, endings = asyncio.run(run())
    victim = owners[-1]
    assert endings[-1] == "cut"
    assert all(end == "complete" for owner, end in zip(owners, endings) if owner != victim), (owners, endings)
    assert all(end in ("cut", "complete") for end in endings), endings  # the victim's older ones may have ended
    (new,) = fronts.wait_fronts(1, 120, besides=before)
    assert victim not in fronts.fronts() and new != victim
    deadline = time.monotonic() + 30
    while (running := _gauge(fronts.root, "infer_num_requests_running")) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert running == 0
    assert asyncio.run(_complete_each(fronts.root, PROMPTS[:4])) == expected[:4]
    assert "API server" in fronts.log.read_text() and "starting it again" in fronts.log.read_text()


def _connections(pid: int, port: int) -> int:
    """Established TCP connections to `port` that process `pid` holds (/proc/net/tcp's inodes among its fds)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            inodes.add(f"socket:[{fields[9]}]")
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd) in inodes
        except OSError:
            continue
    return count


def _gauge(root: str, name: str) -> float:
    text = httpx.get(f"{root}/metrics", timeout=10).text
    return float(re.search(rf'^{name}{{model="{MODEL}"}} (\S+)$', text, re.M)[1])


def test_sigterm_drains_every_front(fronts):
    """Last of the module's server: JSON requests on both fronts at SIGTERM all finish; exit 0, no process left."""
    tree = fronts.tree()

    async def run() -> list[str]:
        clients = [httpx.AsyncClient(timeout=120) for _ in range(6)]
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(c.post(f"{fronts.root}/v1/completions", json=body)) for c in clients]
        await asyncio.sleep(1.0)
        fronts.process.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*tasks)
        for c in clients:
            await c.aclose()
        return [a.json()["choices"][0]["finish_reason"] if a.status_code == 200 else a.text for a in answers]

    assert asyncio.run(run()) == ["length"] * 6
    assert fronts.exit_code() == 0
    assert_gone(tree, timeout_s=20)


def test_a_dead_engine_stops_every_front(tiny_chat_dir, tmp_path):
    server = Fronts(tiny_chat_dir, tmp_path / "serve.log", "--shutdown-timeout", "5")
    try:
        tree = server.tree()
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert server.exit_code() == 5
        assert_gone(tree, timeout_s=20)
        assert server.log.read_text().count(f"the engine of {MODEL} stopped") == 2  # each front said it
    finally:
        server.stop()


def test_the_store_process_ends_with_the_server(tmp_path):
    """The server's own process killed with -9 cannot shut the response store's process down: it ends by
    itself, and removes the fronts' metrics directory (the engine ends at its pipe's end, then the fronts with
    their engine: the tests above)."""
    script = tmp_path / "parent.py"
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    script.write_text(
        "import multiprocessing, os, sys\n"
        "from infer.serve.fronts import _StoreManager, _store_process\n"
        "if __name__ == '__main__':\n"
        "    manager = _StoreManager(ctx=multiprocessing.get_context('spawn'))\n"
        "    manager.start(_store_process, (sys.argv[1],))\n"
        "    print(manager._process.pid, flush=True)\n"
        "    os._exit(0)  # as a SIGKILL would: no shutdown\n"
    )
    done = subprocess.run([sys.executable, str(script), str(metrics)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_gone({int(done.stdout.split()[0])}, timeout_s=10)
    assert not metrics.exists()  # the metrics directory the server could not remove


def _refused(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from infer.cli.main import cli
    from infer.cli.serve import serve

    if "serve" not in cli.commands:  # `infer serve` is a plugin's command, added when `infer` starts
        cli.add_command(serve)
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--restart-engine"], "--restart-engine"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating"),
        (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray"),
    ],
)
def test_what_fronts_cannot_do_is_refused_first(flags, named):
    code, output = _refused("serve", "--model", "no-such-model", "--api-server-count", "2", *flags)
    assert code == 2
    assert named in output and "--api-server-count" in output and "Traceback" not in output


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def test_a_front_that_stops_reading_never_blocks_the_engine_thread():
    """The engine's thread sends to a front that reads nothing: every send returns at once (a sender thread of
    the front's own blocks instead), snapshots are not queued behind, and past MAX_PENDING messages the link
    is `stalled`, for the main thread to drop; closing it ends the blocked sender."""
    import multiprocessing
    import threading

    from infer.serve.engine_child import MAX_PENDING, _Link

    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    link = _Link(ours, first=False)
    payload = ("items", [(0, "x" * 4096)])  # the pipe's buffer fills within a few dozen of these
    started = time.monotonic()
    for _ in range(MAX_PENDING + 50):
        link.send(payload)
        link.send(("snapshot", None))
    assert time.monotonic() - started < 5
    assert link.stalled and link._queue.qsize() <= MAX_PENDING + 1  # and one slot for the latest snapshot
    senders = [t for t in threading.enumerate() if t.name == "infer-front-sender"]
    link.close()
    for thread in senders:
        thread.join(10)
    assert not any(t.is_alive() for t in senders) and ours.closed
    theirs.close()


def test_data_parallel_fronts_route_over_the_live_replicas(tiny_chat_dir, tmp_path, expected):
    """-dp 2 behind 2 fronts: a replica killed, then a front: the new front starts over the live replica, answers
    as LLM does, and SIGTERM still ends the server with exit code 0."""
    server = Fronts(tiny_chat_dir, tmp_path / "serve.log", "--data-parallel-size", "2")
    try:
        assert asyncio.run(_complete_each(server.root, PROMPTS[:4])) == expected[:4]
        fronts = set(server.fronts())
        spawned = [p for p in descendants(server.process.pid) if b"spawn_main" in cmdline(p) and p not in fronts]
        replica = sorted(spawned, key=_rss)[-1]  # an engine: the most memory (the store's process is small)
        os.kill(replica, signal.SIGKILL)
        os.kill(min(fronts), signal.SIGKILL)
        server.wait_fronts(1, 120, besides=fronts)
        assert asyncio.run(_complete_each(server.root, PROMPTS[:4])) == expected[:4]
        server.process.send_signal(signal.SIGTERM)
        assert server.exit_code() == 0
    finally:
        server.stop()


def test_a_front_link_sends_the_latest_snapshot_and_closes_only_when_told():
    """Snapshots behind other messages collapse to the latest, which still goes out once the engine is idle;
    a front that died (its end closed) leaves the link open for the main thread, which closes it."""
    import multiprocessing
    import threading

    from infer.serve.engine_child import _Link

    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    link = _Link(ours, first=False)
    for i in range(50):
        link.send(("items", [(0, i)]))
        link.send(("snapshot", i))  # the last one is the idle engine's: nothing is published after it
    got = []
    while len([m for m in got if m[0] == "items"]) < 50 or theirs.poll(0.5):
        assert theirs.poll(10), got[-5:]
        got.append(theirs.recv())
    assert [m for m in got if m[0] == "items"] == [("items", [(0, i)]) for i in range(50)]
    snapshots = [m[1] for m in got if m[0] == "snapshot"]
    assert snapshots[-1] == 49 and snapshots == sorted(set(snapshots))  # the latest, in order, none twice
    theirs.close()  # the front dies
    link.send(("items", [(0, "after")]))
    deadline = time.monotonic() + 10
    while not link.gone and time.monotonic() < deadline:
        link.send(("items", [(0, "after")]))
        time.sleep(0.05)
    assert link.gone and not ours.closed  # the main thread may still wait on it: it closes it itself
    senders = [t for t in threading.enumerate() if t.name == "infer-front-sender"]
    link.close()
    for thread in senders:
        thread.join(10)
    assert ours.closed
