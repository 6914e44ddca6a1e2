"""One client never stalls or kills the server: each attack of the table is sent to a live `infer serve`
(SmolLM2-135M on the CPU, a process of its own, as users run it) while 8 greedy streams run beside it.
The attack gets its documented answer (a 4xx, or it completes), the neighbours' tokens equal the
offline output, and their worst gap between two tokens stays under NEIGHBOUR_GAP_S; nothing is a 500,
and the server's memory stays bounded.

Scaled to two CPU cores: the header and body timeouts are 2 s, a grammar's compile budget 3 s."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import pytest
from launchers import free_port  # tests/, on sys.path

from infer import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEIGHBOUR_GAP_S = 2.0  # the worst wait between two tokens of a neighbour, on two shared CPU cores
NUM_NEIGHBOURS = 8
NEIGHBOUR_TOKENS = 24
MAX_RSS_GROWTH_MB = 400  # the front's and the engine's resident memory over the whole table
PROMPTS = [f"Tell me about the number {i}." for i in range(NUM_NEIGHBOURS)]
SERVER = [
    "--attention", "torch", "--max-model-len", "8192", "--header-timeout", "2", "--body-timeout", "2",
    "--structured-compile-timeout-s", "3", "--max-step-ms", "300",
]  # fmt: skip


def _rss_mb(pid: int) -> float:
    """The resident memory of a process and its children, in MB."""
    total = 0.0
    pids = [pid]
    children = f"/proc/{pid}/task/{pid}/children"
    if os.path.exists(children):
        pids += [int(p) for p in open(children).read().split()]
    for p in pids:
        with open(f"/proc/{p}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


@dataclass
class Server:
    process: subprocess.Popen
    root: str
    port: int


@pytest.fixture(scope="module")
def server(smollm2_dir):
    port = free_port()
    command = [sys.executable, "-m", "infer.cli.main", "serve", "--model", f"{smollm2_dir}:name=smol"]
    command += [*SERVER, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.5)
    yield Server(process, root, port)
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def offline(smollm2_dir) -> list[list[int]]:
    llm = LLM(model=str(smollm2_dir), attention="torch")
    try:
        params = SamplingParams(max_tokens=NEIGHBOUR_TOKENS, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


@dataclass
class Neighbour:
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None

    def run(self, root: str) -> None:
        body = {
            "model": "smol", "prompt": self.prompt, "max_tokens": NEIGHBOUR_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        try:
            with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    self.error = f"{response.status_code} {response.read()!r}"
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                        return
                    tokens = chunk["choices"][0]["logprobs"]["tokens"]
                    self.token_ids += [int(t.removeprefix("token_id:")) for t in tokens]
                    self.arrivals += [time.monotonic()] * len(tokens)
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def worst_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def _with_neighbours(server: Server, attack: Callable[[Server], Any]) -> tuple[Any, list[Neighbour]]:
    """Run `attack` once every neighbour has its first token, while they stream; returns its result."""
    neighbours = [Neighbour(p) for p in PROMPTS]
    threads = [threading.Thread(target=n.run, args=(server.root,)) for n in neighbours]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(n.arrivals or n.error for n in neighbours) and time.monotonic() < deadline:
        time.sleep(0.01)
    result = attack(server)
    for t in threads:
        t.join(180)
    return result, neighbours


def _post(path: str, body: Any, timeout: float = 120, **kw: Any) -> Callable[[Server], httpx.Response]:
    def send(server: Server) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json"}
        return httpx.post(f"{server.root}{path}", content=content, headers=headers, timeout=timeout, **kw)

    return send


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "smol", "prompt": "Hi", "max_tokens": 2, **fields}


def _slowloris(server: Server) -> dict[str, Any]:
    """300 connections send half a request's headers and stop: each is closed by the server."""
    sockets = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        sockets.append(s)
    started, closed = time.monotonic(), 0
    for s in sockets:
        s.settimeout(max(0.1, 15 - (time.monotonic() - started)))
        try:
            closed += s.recv(1024) is not None  # b"" (closed) or an error answer: either ends it
        except (TimeoutError, socket.timeout):
            pass
        except OSError:
            closed += 1
        s.close()
    return {"closed": closed, "seconds": time.monotonic() - started}


def _short_body(server: Server) -> dict[str, Any]:
    """A body shorter than its Content-Length: answered 408 once the body timeout passes."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = b'{"model": "smol", "prompt": "Hi"'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body) + 100}"
    started = time.monotonic()
    s.sendall(head.encode() + b"\r\n\r\n" + body)
    answer = s.recv(4096)
    s.close()
    return {"status_line": answer.split(b"\r\n", 1)[0].decode(), "seconds": time.monotonic() - started}


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _props(n: int, prefix: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (name, attack, the statuses it may get (a 200: it completed), a word its error message holds)
ATTACKS: list[tuple[str, Callable[[Server], Any], set[int], str | None]] = [
    ("body 50 MB", _post("/v1/chat/completions", _chat("x" * 50_000_000)), {413}, "max-request-bytes"),
    ("prompt 10 MB", _post("/v1/completions", _completion(prompt="hello " * 1_700_000)), {413}, "max-request-bytes"),
    ("prompt 3 MB", _post("/v1/completions", _completion(prompt="hello " * 500_000)), {400}, "shorten"),
    ("chat 3 MB", _post("/v1/chat/completions", _chat("word " * 600_000)), {400}, "shorten"),
    ("tokenize 3 MB", _post("/tokenize", {"model": "smol", "prompt": "a " * 1_500_000}), {400}, "shorten"),
    ("schema 3,000 properties (86 KiB)", _post("/v1/chat/completions", _chat("x", response_format=_schema_format(_props(3000)))), {400}, None),
    ("schema 2,000 properties (59 KB)", _post("/v1/chat/completions", _chat("x", response_format=_schema_format(_props(2000, "s")))), {200, 400}, "structured_compile_timeout_s"),
    ("schema nesting 200", _post("/v1/chat/completions", _chat("x", response_format=_schema_format(_deep(200)))), {400}, "depth"),
    ("guided_choice 20,000", _post("/v1/completions", _completion(guided_choice=[f"option {i}" for i in range(20_000)])), {400}, None),
    ("regex [\\s\\S]{0,50000}", _post("/v1/completions", _completion(guided_regex=r"[\s\S]{0,50000}")), {200, 400}, "structured_compile_timeout_s"),
    ("prompt of 4,000 tokens", _post("/v1/completions", {"model": "smol", "prompt": [7] * 4000, "max_tokens": 1}, timeout=300), {200}, None),
    ("stop strings 10,000", _post("/v1/completions", _completion(stop=["x"] * 10_000)), {400}, "stop"),
    ("logit_bias 20,000", _post("/v1/completions", _completion(logit_bias={str(i): 1 for i in range(20_000)})), {400}, "logit_bias"),
    ("n as a string", _post("/v1/completions", _completion(n="5")), {400}, None),
    ("max_tokens as a string", _post("/v1/completions", _completion(max_tokens="5")), {400}, None),
    ("temperature true", _post("/v1/completions", _completion(temperature=True)), {400}, None),
    ("stream 'yes'", _post("/v1/completions", _completion(stream="yes")), {400}, None),
    ("$ref to a URL", _post("/v1/chat/completions", _chat("x", response_format=_schema_format({"$ref": "http://example.com/s.json"}))), {400}, "$ref"),
    ("$ref to a file", _post("/v1/chat/completions", _chat("x", response_format=_schema_format({"$ref": "file:///etc/passwd"}))), {400}, "$ref"),
    ("tokenize a lone surrogate", _post("/tokenize", '{"model": "smol", "prompt": "a\\ud800b"}'), {400}, "surrogate"),
    ("300 half-sent headers", _slowloris, set(), None),
    ("a body short of its Content-Length", _short_body, set(), None),
]  # fmt: skip


@pytest.fixture(scope="module")
def baseline_rss(server, offline) -> float:
    _, neighbours = _with_neighbours(server, lambda s: None)  # the engine and pools warm, then measured
    assert [n.token_ids for n in neighbours] == offline
    return _rss_mb(server.process.pid)


@pytest.mark.parametrize("name, attack, statuses, words", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_an_attack_beside_eight_streams(server, offline, baseline_rss, name, attack, statuses, words):
    result, neighbours = _with_neighbours(server, attack)
    assert server.process.poll() is None, "the server died"
    assert [n.error for n in neighbours] == [None] * NUM_NEIGHBOURS
    assert [n.token_ids for n in neighbours] == offline  # the neighbours' answers are untouched
    worst = max(n.worst_gap() for n in neighbours)
    assert worst < NEIGHBOUR_GAP_S, f"a neighbour waited {worst:.2f} s between two tokens"
    if isinstance(result, httpx.Response):
        assert result.status_code in statuses, (result.status_code, result.text[:500])
        if result.status_code >= 400:
            error = result.json()["error"]
            assert error["message"] and error["type"]
            if words is not None and result.status_code != 200:
                assert words in error["message"] or words == error["param"], error
    elif name.startswith("300"):
        assert result["closed"] == 300 and result["seconds"] < 10, result
    else:
        assert result["status_line"].startswith("HTTP/1.1 408") and result["seconds"] < 10, result
    assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200
    growth = _rss_mb(server.process.pid) - baseline_rss
    assert growth < MAX_RSS_GROWTH_MB, f"the server's memory grew {growth:.0f} MB"
