"""Serving fixtures: engines served by AsyncEngine, and live uvicorn servers on loopback (a free port, a
thread of their own) that tests reach with the official `openai` client and httpx.

Serving tests run an engine thread beside the event loop (and a server thread and its clients): one
intra-op torch thread keeps them from spinning against each other on a small machine."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from infer import LLM
from infer.serve.async_engine import AsyncEngine


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Served:
    """An LLM whose engine an AsyncEngine serves; `offline` runs LLM.generate/chat on the engine's thread,
    between steps (call it while no request is in flight)."""

    def __init__(self, llm: LLM, max_waiting: int | None = None) -> None:
        self.llm = llm
        self.engine = AsyncEngine(llm.engine, max_waiting=max_waiting)

    def offline(self, fn):
        async def run():
            return await self.engine.call(lambda engine: fn(self.llm))

        return asyncio.run(run())

    def idle(self) -> tuple[int, bool]:
        """(KV blocks in use, whether anything is unfinished) between two steps."""
        return self.offline(lambda llm: (llm.engine.kv_usage().num_used_blocks, llm.engine.has_unfinished()))

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="session")
def smol(smollm2_dir):
    served = Served(LLM(model=str(smollm2_dir), attention="torch", num_kv_blocks=320, max_model_len=1024))
    yield served
    served.close()


@pytest.fixture(scope="session")
def tiny(tiny_chat_dir):
    served = Served(LLM(model=str(tiny_chat_dir), attention="torch", num_kv_blocks=128, max_model_len=256))
    yield served
    served.close()


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a thread; `url` is its /v1 base; `options`:
    more of uvicorn.Config's keyword arguments (`http_limits.uvicorn_options(limits)`)."""

    def __init__(self, app, **options) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, **options)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


@pytest.fixture(scope="module")
def live():
    """live(app, **uvicorn_options) -> a LiveServer, stopped at the end of the test module."""
    servers: list[LiveServer] = []

    def start(app, **options) -> LiveServer:
        servers.append(LiveServer(app, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
