"""Slow and greedy clients at the HTTP level, over raw sockets against a live server with the timeouts
scaled down: a body past --max-request-bytes is a 413 (at once by its Content-Length, or once a chunked
body passes it), a body that stalls or stops short of its Content-Length a 408, and both close the
connection; connections holding partial headers (200 of them, or one trickling a byte at a time) are
closed by --header-timeout while a normal request is answered beside them; idle keep-alive connections
by --keep-alive-timeout."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from infer.serve.app import create_app
from infer.serve.http_limits import HeaderTimeout, uvicorn_options
from infer.serve.limits import ServeLimits

MODEL = "tiny"
TIMEOUT_S = 0.5  # the header, body and keep-alive timeouts here
SLACK_S = 2.5  # what a loaded two-core machine may add to a timeout
LIMITS = ServeLimits(
    max_request_bytes=4096, body_timeout_s=TIMEOUT_S, header_timeout_s=TIMEOUT_S, keep_alive_timeout_s=TIMEOUT_S
)
TOKENIZE = b"POST /tokenize HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(tiny, live):
    return live(create_app({MODEL: tiny.engine}, limits=LIMITS), **uvicorn_options(LIMITS))


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _until_closed(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sends until it closes the connection, which it must within `within_s`."""
    deadline, got = time.monotonic() + within_s, b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the connection is still open after {within_s} s (got {got[:200]!r})"
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            continue
        if not data:
            return got
        got += data


def _error(answer: bytes, status: int) -> dict:
    """The OpenAI error of a raw HTTP answer, which must have `status` and close the connection."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), answer[:300]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_the_options_reach_uvicorn():
    options = uvicorn_options(LIMITS)
    assert options["timeout_keep_alive"] == TIMEOUT_S
    assert options["http"].func is HeaderTimeout and options["http"].keywords == {"header_timeout_s": TIMEOUT_S}


def test_a_content_length_past_the_limit_is_a_413_before_the_body_is_read(server):
    with _connect(server) as sock:
        sock.sendall(TOKENIZE + b"Content-Length: 10000000\r\n\r\n")  # and no body
        error = _error(_until_closed(sock, SLACK_S), 413)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "--max-request-bytes" in error["message"] and "4096" in error["message"]


def test_a_chunked_body_is_counted_as_it_arrives(server):
    chunk = b"400\r\n" + b" " * 1024 + b"\r\n"  # 1 KiB of a JSON body's whitespace
    with _connect(server) as sock:
        sock.sendall(TOKENIZE + b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        while not select.select([sock], [], [], 0.02)[0]:  # until the server answers
            assert sent < 1024 * 1024, "1 MiB sent and no 413"
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1024
        error = _error(_until_closed(sock, SLACK_S), 413)
    assert error["code"] == "request_too_large"


def test_bodies_within_the_limit_pass_and_one_past_it_through_httpx_is_a_413(server):
    with httpx.Client(base_url=server.root, timeout=30) as http:
        ok = http.post("/tokenize", json={"model": MODEL, "prompt": "hello " * 500})  # ~3 KB
        assert ok.status_code == 200, ok.text
        big = http.post("/tokenize", json={"model": MODEL, "prompt": "hello " * 700})  # ~4.2 KB
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_body_shorter_than_its_content_length_is_a_408(server):
    start = time.monotonic()
    with _connect(server) as sock:
        sock.sendall(TOKENIZE + b'Content-Length: 100\r\n\r\n{"prompt": ')
        error = _error(_until_closed(sock, TIMEOUT_S + SLACK_S), 408)
    assert time.monotonic() - start >= TIMEOUT_S * 0.9
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_body_in_pieces_within_the_timeout_is_read_whole(server):
    body = json.dumps({"model": MODEL, "prompt": "one two three"}).encode()
    with _connect(server) as sock:
        sock.sendall(TOKENIZE + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        for i in range(0, len(body), 16):  # each piece well within the timeout, the whole longer than it
            time.sleep(TIMEOUT_S / 3)
            sock.sendall(body[i : i + 16])
        answer = _until_closed(sock, SLACK_S)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["count"] == 3


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_200_connections_holding_partial_headers_are_closed_while_a_request_is_answered(server):
    socks = [_connect(server) for _ in range(200)]
    try:
        start = time.monotonic()
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # and never the blank line
        with httpx.Client(base_url=server.root, timeout=10) as http:  # a client beside them is answered
            assert http.get("/health").status_code == 200
            assert http.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 200
        answers = {sock: b"" for sock in socks}
        open_ = set(socks)
        while open_ and time.monotonic() - start < TIMEOUT_S + SLACK_S:
            for sock in select.select(list(open_), [], [], 0.1)[0]:
                data = sock.recv(65536)
                answers[sock] += data
                if not data:
                    open_.discard(sock)
        assert not open_, f"{len(open_)} of 200 connections still open after {TIMEOUT_S + SLACK_S} s"
        for answer in answers.values():
            assert "--header-timeout" in _error(answer, 408)["message"]
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_headers_trickling_in_do_not_push_the_deadline_back(server):
    start = time.monotonic()
    with _connect(server) as sock:
        request = TOKENIZE * 100  # never ends in a blank line
        for byte in request:
            if select.select([sock], [], [], 0.05)[0]:
                break
            sock.sendall(bytes([byte]))
        else:
            pytest.fail("the server kept reading trickled headers")
        _error(_until_closed(sock, SLACK_S), 408)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_silent_and_idle_keep_alive_connections_are_closed(server):
    with _connect(server) as sock:  # opens and sends nothing: closed, with nothing said
        assert _until_closed(sock, TIMEOUT_S + SLACK_S) == b""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        answer = _until_closed(sock, TIMEOUT_S + SLACK_S)  # answered, then closed once idle
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')
