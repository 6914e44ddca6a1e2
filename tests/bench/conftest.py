"""A fake OpenAI-compatible server on loopback for `infer bench serve`: known sleeps before the first
chunk and between chunks, usage in the stream, failures on demand, and the peak of streams in flight."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest


@dataclass
class FakeServer:
    first_s: float = 0.0  # sleep before the first chunk
    gap_s: float = 0.0  # sleep before each later chunk
    tokens_per_chunk: int = 1
    usage: bool = True  # a usage chunk before [DONE] when stream_options.include_usage asks
    fail_every: int = 0  # every Nth completion request answers HTTP 500 (0: none)
    cut_every: int = 0  # every Nth completion request is cut off after its first chunk (0: none)
    junk_every: int = 0  # every Nth completion request streams an event whose data is not JSON (0: none)
    api_key: str | None = None  # required as a bearer token when set
    text: str = "tok "  # each token's text ("" as from a model served without a tokenizer)
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every completion request's JSON body
    in_flight: int = 0
    peak: int = 0  # most completion streams open at once
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not reader.at_eof():
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self.route(method, path, headers, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, headers: dict, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is to be dropped."""
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return await self.json(writer, 401, {"error": {"message": "invalid API key", "code": 401}})
        if (method, path) == ("GET", "/v1/models"):
            return await self.json(writer, 200, {"object": "list", "data": [{"id": m} for m in self.models]})
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return await self.json(writer, 404, {"error": {"message": f"no route {path}"}})
        request = json.loads(body)
        self.bodies.append(request)
        n = len(self.bodies)
        if self.fail_every and n % self.fail_every == 0:
            return await self.json(writer, 500, {"error": {"message": "the engine failed", "code": 500}})
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await self.stream(request, path.endswith("chat/completions"), n, writer)
        finally:
            self.in_flight -= 1

    async def stream(self, request: dict, chat: bool, n: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: keep-alive\r\n\r\n"
        )
        total = request.get("max_completion_tokens" if chat else "max_tokens", 16)
        sent = 0
        while sent < total:
            await asyncio.sleep(self.first_s if sent == 0 else self.gap_s)
            k = min(self.tokens_per_chunk, total - sent)
            text = self.text * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await self.event(writer, {"id": "x", "choices": [choice]})
            sent += k
            if self.junk_every and n % self.junk_every == 0:
                await self.event(writer, "{not json")
            if self.cut_every and n % self.cut_every == 0:
                return False  # the connection closes mid-body
        if self.usage and (request.get("stream_options") or {}).get("include_usage"):
            prompt = request.get("prompt", [])
            used = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 3, "completion_tokens": total}
            await self.event(writer, {"id": "x", "choices": [], "usage": used})
        await self.event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def event(self, writer: asyncio.StreamWriter, data: Any) -> None:
        payload = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
        writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        await writer.drain()

    async def json(self, writer: asyncio.StreamWriter, status: int, body: dict) -> bool:
        payload = json.dumps(body).encode()
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status, len(payload), payload)
        )
        await writer.drain()
        return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A FakeServer listening on a free loopback port, served from its own thread and event loop."""
    fake = FakeServer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(fake.handle, "127.0.0.1", 0), loop).result(10)
    fake.port = server.sockets[0].getsockname()[1]
    yield fake

    async def shut_down() -> None:  # the connections still open end here, not with the loop
        server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(shut_down(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
