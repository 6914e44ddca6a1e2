"""The engine's process, as `EngineProcess` starts it: the engine and the thread that steps it, served over
the connections of the fronts (API servers) that send it requests.

The first connection is that of the process that started it; more come through it (`Attach`: a front in
another process, `--api-server-count`). Each connection stands in for an event loop (`_Link`): a step's
outputs for that front's requests cross it as one message, a call's result goes back over the connection
that sent the call, and every snapshot goes over all of them. A front's connection that ends (a `Stop`
from it, or its process died) has the requests it left unfinished aborted; a `Stop` over the first
connection, or its end, stops the engine.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from infer.api.adapters import LoRARequest
from infer.api.errors import ConfigError, InferError, RequestError, one_line
from infer.api.request import SamplingParams
from infer.core.engine import Engine
from infer.core.stream import StreamOutput
from infer.serve.engine_thread import Abort, Add, Call, EngineThread, Item
from infer.serve.snapshot import EngineSnapshot, snapshot

__all__ = ["Attach", "EngineFacts", "RemoteAdd", "RemoteCall", "Stop", "portable", "serve_engine"]


@dataclass(slots=True)
class EngineFacts:
    """What the front needs of an engine built in another process; sent once, when it is built."""

    tokenizer: Any | None  # the engine's tokenizer (None: token ids only)
    vocab_size: int  # token ids must be below it
    max_model_len: int  # prompt + output tokens, at most
    model_name: str  # named in errors about prompts
    snapshot: EngineSnapshot  # its state when built, until the first one published


@dataclass(slots=True)
class RemoteAdd:
    """An `Add` without its sink: the child makes its own, which sends the outputs back under `key`."""

    key: int  # the parent's name for the request's sink: outputs come back under it (ids may be reused)
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class RemoteCall:
    call_id: int  # answered by a ("result", call_id, ok, value) message
    fn: Callable[[Engine], Any]  # picklable: a module-level function


class Stop:
    pass


@dataclass(slots=True)
class Attach:
    conn: Connection  # the child's end of a front's new pipe (it crosses with its file descriptor)


MAX_PENDING = 1000  # messages queued for a front that does not read them: past this it is dropped
_CLOSE = object()
_SNAPSHOT = object()  # in a front's queue: send the latest snapshot


class _Link:
    """One front's connection, in the child: stands in for an event loop (a step's outputs for this front go
    to it as one message) and knows the requests it sent that are unfinished.

    The first connection (the process that started the engine, which always reads) is written by the engine's
    thread itself. Another front's is written by a sender thread of its own, from a queue: a front that stops
    reading (hung, stopped, starved) fills its pipe and blocks that thread only, never the engine's; once
    MAX_PENDING messages wait, it is `stalled` and the main thread drops it (snapshots are not queued behind
    others: a front that is behind gets the next one)."""

    def __init__(self, conn: Connection, first: bool) -> None:
        self.conn = conn
        self.first = first  # the connection of the process that started the engine: its end stops the engine
        self.live: set[str] = set()  # request ids sent over it, not yet finished (kept by the engine's thread)
        self.gone = False
        self.stalled = False
        self._pending = 0  # messages queued, not yet sent (changed under the GIL by two threads: an estimate)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._snapshot: Any = None  # the latest snapshot message, sent once the queue reaches its marker
        self._snapshot_queued = False
        if not first:
            threading.Thread(target=self._send_queued, name="infer-front-sender", daemon=True).start()

    def send(self, message: Any) -> None:
        """From the engine's thread; never blocks for a front other than the first."""
        if self.gone:
            return
        if self.first:
            self.conn.send(message)
            return
        if message[0] == "snapshot":  # one slot, the latest: a front that is behind gets it when it catches up
            self._snapshot = message
            if not self._snapshot_queued:
                self._snapshot_queued = True
                self._queue.put(_SNAPSHOT)
            return
        if self._pending >= MAX_PENDING:
            self.stalled = True
            return
        self._pending += 1
        self._queue.put(message)

    def close(self) -> None:
        """From the main thread: the sender ends (a send blocked on a full pipe fails now) and closes the pipe."""
        self.gone = True
        if self.first:
            self.conn.close()
            return
        try:  # wakes a send blocked on a front that does not read, without freeing the descriptor under it
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._queue.put(_CLOSE)

    def _send_queued(self) -> None:
        """Until `close` (the main thread's, once it found the front gone or stalled): only then the pipe closes,
        so the main thread never waits on a closed connection and no descriptor is reused under it."""
        while (message := self._queue.get()) is not _CLOSE:
            if message is _SNAPSHOT:
                self._snapshot_queued = False
                message = self._snapshot
            else:
                self._pending -= 1
            if self.gone:
                continue
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the front is gone: the main thread finds the pipe's end
                self.gone = True
        self.conn.close()

    def call_soon_threadsafe(self, fn: Callable, batch: list[tuple["_RemoteSink", Item]]) -> None:
        for sink, item in batch:
            if isinstance(item, BaseException) or (isinstance(item, StreamOutput) and item.finished):
                self.live.discard(sink.request_id)
        self.send(("items", [(sink.key, portable(item)) for sink, item in batch]))


@dataclass(slots=True)
class _RemoteSink:
    key: int  # the front's key for this request's sink
    request_id: str
    loop: _Link

    def put(self, item: Item) -> None:  # never called: the link sends instead
        raise AssertionError("a remote sink is delivered through its loop")


def serve_engine(conn: Connection, build: Callable[[], Engine]) -> None:
    """The engine's process: build the engine, say so (or why not) through `conn`, then step it on the
    commands that come through `conn` (and the connections attached through it) until a stop or the end
    of `conn`."""
    # Ctrl-C reaches the terminal's whole process group (and a kill of the group, SIGTERM): the server
    # drains its requests and then stops this process through the pipe; dying here at once would cut that short
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build()
    except BaseException as exc:  # a bad model or option: the parent raises it
        conn.send(("error", exc if isinstance(exc, InferError) else ConfigError(f"{type(exc).__name__}: {exc}")))
        return
    parts = engine.parts
    facts = EngineFacts(
        engine.tokenizer, parts.vocab_size, parts.max_model_len, parts.model_config.name, snapshot(engine)
    )
    conn.send(("ready", facts))
    # after "ready" every send of this process is the engine thread's (outputs, results, snapshots): no lock
    links: dict[Connection, _Link] = {conn: _Link(conn, first=True)}
    fronts = list(links.values())  # replaced, never changed in place: the engine thread reads it

    def publish(snap: EngineSnapshot) -> None:
        for link in fronts:
            link.send(("snapshot", snap))

    thread = EngineThread(engine, publish=publish)
    try:
        while True:
            for link in [link for link in links.values() if link.stalled]:  # a front that stopped reading
                del links[link.conn]
                fronts = list(links.values())
                _drop(link, thread)
            for ready in wait(list(links), timeout=1.0):
                link = links[ready]  # type: ignore[index]
                try:
                    command = link.conn.recv()
                except (EOFError, OSError):  # that front is gone
                    command = Stop()
                if isinstance(command, Stop):
                    if link.first:
                        return
                    del links[link.conn]
                    fronts = list(links.values())
                    _drop(link, thread)
                elif isinstance(command, Attach):
                    links[command.conn] = _Link(command.conn, first=False)
                    fronts = list(links.values())
                else:
                    _apply(command, link, thread)
    finally:
        thread.stop()
        engine.close()


def _apply(command: Any, link: _Link, thread: EngineThread) -> None:
    if isinstance(command, RemoteCall):
        thread.send(Call(command.fn, _answer(link, command.call_id)))
    elif isinstance(command, RemoteAdd):
        link.live.add(command.request_id)
        sink = _RemoteSink(command.key, command.request_id, link)
        thread.send(
            Add(
                command.request_id, command.prompt_token_ids, command.prompt, command.params, sink, command.lora_request
            )
        )
    else:
        thread.send(command)


def _drop(link: _Link, thread: EngineThread) -> None:
    """A front's connection ended: what it left unfinished is aborted (its blocks freed for the others)."""
    link.close()
    for request_id in list(link.live):
        thread.send(Abort(request_id))


def _answer(link: _Link, call_id: int) -> Future:
    future: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        value = portable(exc) if exc is not None else f.result()
        try:
            payload = pickle.dumps(value)
            pickle.loads(payload)
        except Exception as err:  # a result that cannot cross: the caller gets why
            exc, value = err, RequestError(f"the call's result cannot leave the engine's process ({one_line(err)})")
        link.send(("result", call_id, exc is None, value))

    future.add_done_callback(done)
    return future


def portable(item: Any) -> Any:
    """An exception as it will unpickle on the other side (one that needs more constructor arguments than
    its message does not): else a RequestError with its text."""
    if not isinstance(item, BaseException):
        return item
    try:
        pickle.loads(pickle.dumps(item))
        return item
    except Exception:
        return RequestError(f"{type(item).__name__}: {one_line(item)}")
