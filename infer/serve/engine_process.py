"""The engine in a process of its own, so the server's event loop and the step loop hold different GILs.

At saturation a server turns every running request's step into a chunk of JSON on its event loop: a
few hundred chunks a step. In one process that work and the engine's step loop take turns on one
GIL, and the GPU waits for the step loop's turn (on an H100 a thread-served llama3-8b gave 0.70-0.80
of `infer run`'s tokens/s on the same requests). Here the child process runs the same `EngineThread`
over its Engine; each step's outputs cross one pipe as one message, and a thread of the parent hands
them to the event loop with one `call_soon_threadsafe`, as the thread-served engine does.

The front keeps what it needs to check requests before they cross (`EngineFront`: the tokenizer and
the limits); calls into the engine (`AsyncEngine.call`) must be picklable: module-level functions.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from infer.core.engine import Engine
from infer.core.errors import ConfigError, InferError, one_line
from infer.inputs.prompts import tokenize
from infer.serve.engine_thread import Abort, Add, Call, EngineStepError, EngineThread, Item, Sink, put_all


@dataclass(slots=True)
class EngineFacts:
    """What the front needs of an engine built in another process; sent once, when it is built."""

    tokenizer: Any | None  # the engine's tokenizer (None: token ids only)
    vocab_size: int  # token ids must be below it
    max_model_len: int  # prompt + output tokens, at most
    model_name: str  # named in errors about prompts


class EngineFront:
    """The front's side of an engine in another process: what `AsyncEngine` reads to check requests."""

    def __init__(self, facts: EngineFacts) -> None:
        self.tokenizer = facts.tokenizer
        self.parts = facts  # .vocab_size, .max_model_len, as an Engine's parts have them

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        facts = self.parts
        return tokenize(prompt, self.tokenizer, facts.vocab_size, facts.max_model_len, facts.model_name)

    def close(self) -> None:
        """The process owns the engine: `EngineProcess.stop` frees it."""


@dataclass(slots=True)
class _RemoteCall:
    call_id: int  # answered by a ("result", call_id, ok, value) message
    fn: Callable[[Engine], Any]  # picklable: a module-level function


class _Stop:
    pass


class EngineProcess:
    """`EngineThread`'s interface (send, stop, is_alive) over an engine that `build()` makes in a spawned
    process. Raises what `build` raised (a ConfigError for a bad model, ...) when the engine cannot be built."""

    def __init__(self, build: Callable[[], Engine], name: str = "infer-engine") -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = context.Pipe()
        # not a daemon: a tensor-parallel engine starts rank processes of its own
        self._process = context.Process(target=_child_main, args=(child, build), name=name)
        self._process.start()
        child.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise ConfigError(
                f"the engine's process exited while building the engine (exit code {self._process.exitcode}): "
                f"see its output above"
            ) from None
        if kind == "error":
            self._process.join()
            raise payload
        self.front = EngineFront(payload)
        self._sinks: dict[str, Sink] = {}  # request id -> where its outputs go, while unfinished
        self._calls: dict[int, Future] = {}  # call id -> its caller's future
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def send(self, command: Add | Abort | Call) -> None:
        """From any thread: applied in the engine's process before its next step."""
        if isinstance(command, Add):
            self._sinks[command.request_id] = command.sink
            command = Add(command.request_id, command.prompt_token_ids, command.prompt, command.params, None)  # type: ignore[arg-type]
        elif isinstance(command, Call):
            call_id = next(self._call_ids)
            self._calls[call_id] = command.future
            command = _RemoteCall(call_id, command.fn)  # type: ignore[assignment]
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError) as exc:  # the process is gone: the reader ends every stream
            raise EngineStepError(f"the engine's process is gone ({one_line(exc)}): restart the server") from None

    def stop(self, timeout: float | None = 30.0) -> None:
        """End the process after the commands already sent (unfinished requests get a RequestError)."""
        try:
            with self._send_lock:
                self._conn.send(_Stop())
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        self._reader.join(5)

    @property
    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    def _read(self) -> None:
        """The parent's reader thread: each message, one step's outputs (or a call's result)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "items":
                self._deliver(message[1])
            else:
                _, call_id, ok, value = message
                future = self._calls.pop(call_id)
                future.set_result(value) if ok else future.set_exception(value)
        gone = EngineStepError("the engine's process ended: the requests in flight ended; restart the server")
        self._deliver([(request_id, gone) for request_id in list(self._sinks)])
        for future in self._calls.values():
            future.set_exception(gone)

    def _deliver(self, items: list[tuple[str, Item]]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Sink, Item]]] = {}
        for request_id, item in items:
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._sinks[request_id]
            batches.setdefault(sink.loop, []).append((sink, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass


# ---------------------------------------------------------------------------- in the engine's process


class _PipeLoop:
    """Stands in for an event loop in the child: a step's outputs go to the parent as one message."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def call_soon_threadsafe(self, fn: Callable, batch: list[tuple["_RemoteSink", Item]]) -> None:
        self.conn.send(("items", [(sink.request_id, item) for sink, item in batch]))


@dataclass(slots=True)
class _RemoteSink:
    request_id: str
    loop: Any  # the _PipeLoop

    def put(self, item: Item) -> None:  # never called: _PipeLoop sends instead
        raise AssertionError("a remote sink is delivered through its loop")


def _child_main(conn: Connection, build: Callable[[], Engine]) -> None:
    try:
        engine = build()
    except BaseException as exc:  # a bad model or option: the parent raises it
        conn.send(("error", exc if isinstance(exc, InferError) else ConfigError(f"{type(exc).__name__}: {exc}")))
        return
    parts = engine.parts
    conn.send(("ready", EngineFacts(engine.tokenizer, parts.vocab_size, parts.max_model_len, parts.model_config.name)))
    loop = _PipeLoop(conn)
    thread = EngineThread(engine)
    try:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if isinstance(command, _Stop):
                break
            if isinstance(command, _RemoteCall):
                thread.send(Call(command.fn, _answer(conn, command.call_id)))
            elif isinstance(command, Add):
                command.sink = _RemoteSink(command.request_id, loop)
                thread.send(command)
            else:
                thread.send(command)
    finally:
        thread.stop()
        engine.close()


def _answer(conn: Connection, call_id: int) -> Future:
    future: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        conn.send(("result", call_id, exc is None, exc if exc is not None else f.result()))

    future.add_done_callback(done)
    return future
