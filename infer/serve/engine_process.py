"""The engine in a process of its own, so the server's event loop and the step loop hold different GILs.

At saturation a server turns every running request's step into a chunk of JSON on its event loop: a
few hundred chunks a step. In one process that work and the engine's step loop take turns on one
GIL, and the GPU waits for the step loop's turn (on an H100 a thread-served llama3-8b gave 0.70-0.80
of `infer run`'s tokens/s on the same requests). Here the child process runs the same `EngineThread`
over its Engine; each step's outputs cross one pipe as one message, and a thread of the parent hands
them to the event loop with one `call_soon_threadsafe`, as the thread-served engine does.

The front keeps what it needs to check requests before they cross (`EngineFront`: the tokenizer and
the limits); calls into the engine (`AsyncEngine.call`) must be picklable: module-level functions.
The engine's state for /metrics crosses the same pipe (`EngineThread` publishes an `EngineSnapshot`
after a step at most every 0.25 s): `snapshot` is the latest, read without a call into the child.

When the child dies (killed, out of memory), the reader thread finds the pipe's end: every request
in flight ends with an `EngineDeadError` (a 503 to an HTTP client), and so does every command sent
after; `is_alive` turns False and `exitcode` says how it ended. The child ignores SIGINT and SIGTERM:
a terminal's Ctrl-C or a `kill` of the whole process group reaches it too, and the server, which
drains its requests first, stops it through the pipe; if the server itself dies, the pipe's end
stops the child.

More than one front (`--api-server-count`: API server processes beside the one that started the
engine) reach the same engine through connections of their own: `attach()` hands the child one end of
a new pipe over the first, and returns the other end with the engine's facts, for
`EngineProcess.attached` in the front's process. The child serves every connection; outputs and call
results go back over the connection that sent the request, snapshots over all of them. A front that
ends its connection (`stop`, or its process died) has its unfinished requests aborted; only the first
connection's stop, or its end, stops the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Protocol

from infer.api.errors import ConfigError, one_line
from infer.core.engine import Engine
from infer.core.stream import StreamOutput
from infer.inputs.prompts import tokenize
from infer.serve.engine_child import Attach, EngineFacts, RemoteAdd, RemoteCall, Stop, serve_engine
from infer.serve.engine_thread import (
    Abort,
    Add,
    Call,
    EngineDeadError,
    EngineStepError,
    Item,
    Sink,
    hand_over,
)
from infer.serve.snapshot import EngineSnapshot


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
class EngineLink:
    """A connection to a running engine's process, for a front in another process (`EngineProcess.attached`)."""

    conn: Connection
    facts: EngineFacts


class _Attached:
    """`ChildProcess` for an engine this process did not start: whether it lives is the connection's to say."""

    pid = None
    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


class ChildProcess(Protocol):
    """What `EngineProcess` needs of the engine's process: multiprocessing.Process's names."""

    pid: int | None

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    @property
    def exitcode(self) -> int | None: ...


# starts the engine's process running `serve_engine(conn, build)` at the other end of the connection it returns
Starter = Callable[[Callable[[], Engine], str], tuple[Connection, ChildProcess]]


def _spawn_child(build: Callable[[], Engine], name: str) -> tuple[Connection, ChildProcess]:
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    conn, child = context.Pipe()
    # not a daemon: a tensor-parallel engine starts rank processes of its own
    process = context.Process(target=serve_engine, args=(child, build), name=name)
    process.start()
    child.close()
    return conn, process


class EngineProcess:
    """`EngineThread`'s interface (send, stop, is_alive) over an engine that `build()` makes in a spawned
    process. Raises what `build` raised (a ConfigError for a bad model, ...) when the engine cannot be built."""

    def __init__(self, build: Callable[[], Engine], name: str = "infer-engine", start: "Starter | None" = None) -> None:
        """start: how the engine's process is started and reached (default: a spawned child of this process,
        over a pipe; `infer.serve.ray_executor` places it with Ray and reaches it over a socket)."""
        self._conn, self._process = (start or _spawn_child)(build, name)
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise ConfigError(
                f"the engine's process exited while building the engine (exit code {self._process.exitcode}): "
                f"see its output above"
            ) from None
        except BaseException:  # interrupted while it builds (Ctrl-C): no child outlives its parent
            self._process.terminate()
            self._process.join(5)
            raise
        if kind == "error":
            self._process.join()
            raise payload
        self._connected(payload, name)

    @classmethod
    def attached(cls, link: EngineLink, name: str = "infer-engine") -> "EngineProcess":
        """The engine behind `link` (another process's `attach()`), from this process: its requests and calls
        go over the link; `stop` ends the link (aborting what it left unfinished), not the engine."""
        self = cls.__new__(cls)
        self._conn, self._process = link.conn, _Attached()
        self._connected(link.facts, name)
        return self

    def attach(self) -> EngineLink:
        """A new connection to this engine, for a front in another process (pass the link to it when it starts,
        then `close_link` here)."""
        mine, theirs = multiprocessing.get_context("spawn").Pipe()
        try:
            with self._send_lock:
                self._conn.send(Attach(theirs))
        except Exception:
            mine.close()
            raise self._dead() from None
        finally:
            theirs.close()  # it crossed to the child as a duplicate
        return EngineLink(mine, dataclasses.replace(self.facts, snapshot=self.snapshot))

    def _connected(self, payload: EngineFacts, name: str) -> None:
        self.facts = payload
        self.front = EngineFront(payload)
        self.snapshot: EngineSnapshot = payload.snapshot  # the latest the child published
        self._gone = False  # the pipe's end was found: the child is dead or stopping
        self._sinks: dict[int, Sink] = {}  # sink key -> where a request's outputs go, while unfinished
        self._calls: dict[int, Future] = {}  # call id -> its caller's future
        self._ids = itertools.count()  # sink keys and call ids
        self._send_lock = threading.Lock()
        # at interpreter exit without stop(): close the pipe (the child stops at its end) and join it, before
        # multiprocessing's own exit handler waits for the (non-daemon) child forever
        self._finalizer = weakref.finalize(self, _shut_down, self._conn, self._process)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def send(self, command: Add | Abort | Call) -> None:
        """From any thread: applied in the engine's process before its next step."""
        key = next(self._ids)
        message: Any = command
        if isinstance(command, Add):
            self._sinks[key] = command.sink
            message = RemoteAdd(
                key, command.request_id, command.prompt_token_ids, command.prompt, command.params, command.lora_request
            )
        elif isinstance(command, Call):
            self._calls[key] = command.future
            message = RemoteCall(key, command.fn)
        try:
            if self._gone:  # checked after the sink is in: else the reader's last pass has it
                raise EOFError
            with self._send_lock:
                self._conn.send(message)
        except Exception as exc:  # the process is gone, or fn does not pickle: this command alone fails
            self._sinks.pop(key, None)
            self._calls.pop(key, None)
            if self._gone or not self._process.is_alive():
                raise self._dead() from None
            raise EngineStepError(f"the engine's process cannot take this ({one_line(exc)})") from None

    def stop(self, timeout: float | None = 30.0) -> None:
        """End the process after the commands already sent (unfinished requests get a RequestError)."""
        try:
            with self._send_lock:
                self._conn.send(Stop())
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        self._finalizer()  # the pipe closed; terminated if it did not end
        self._reader.join(5)

    @property
    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it ended (-9: killed by SIGKILL); None while it runs."""
        return self._process.exitcode

    def _dead(self) -> EngineDeadError:
        if isinstance(self._process, _Attached):
            return EngineDeadError(
                "the engine stopped (its connection to this API server ended): the request did not finish; retry "
                "it once the server is back"
            )
        self._process.join(1)  # the pipe's end comes just before the exit code
        code = self._process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        return EngineDeadError(
            f"the engine stopped (its process ended, {how}): the request did not finish; retry it once the server "
            f"is back"
        )

    def _read(self) -> None:
        """The parent's reader thread: each message, one step's outputs (or a call's result)."""
        try:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    break
                if message[0] == "items":
                    self._deliver(message[1])
                    continue
                if message[0] == "snapshot":
                    self.snapshot = message[1]
                    continue
                _, call_id, ok, value = message
                future = self._calls.pop(call_id, None)
                if future is not None and future.set_running_or_notify_cancel():  # else its caller gave up
                    future.set_result(value) if ok else future.set_exception(value)
        finally:
            self._gone = True
            gone = self._dead()
            self._deliver([(key, gone) for key in list(self._sinks)])
            for call_id in list(self._calls):
                future = self._calls.pop(call_id, None)
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(gone)

    def _deliver(self, items: list[tuple[int, Item]]) -> None:
        found = []
        for key, item in items:
            sink = self._sinks.get(key)
            if sink is None:
                continue
            if isinstance(item, BaseException) or (isinstance(item, StreamOutput) and item.finished):
                self._sinks.pop(key, None)
            found.append((sink, item))
        hand_over(found)


def _shut_down(conn: Connection, process: Any) -> None:
    conn.close()
    process.join(30)
    if process.is_alive():
        process.terminate()
        process.join(5)
