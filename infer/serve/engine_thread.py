"""The thread that owns an Engine: the only one that touches it.

It applies what the event loop asked for (new requests, aborts, calls) between steps, steps while
there is work, and sleeps on its queue when there is none. After each step it hands every request's
news to the event loop it came from with one `call_soon_threadsafe`: the step loop does no more
per-token work than `infer run`'s beyond slicing each request's new tokens and text.

It also publishes the engine's state (`snapshot`): after a step at most every `snapshot_interval_s`,
and whenever it goes idle, before that step's outputs leave (so a client that has its answer scrapes
figures that include it). `snapshot` is the latest, readable from any thread; `publish` (if given)
gets each one too: `engine_process` sends them across its pipe.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from infer.api.adapters import LoRARequest
from infer.api.errors import InferError, RequestError, one_line
from infer.api.request import SamplingParams
from infer.common.log import get_logger
from infer.core.engine import Engine
from infer.core.stream import News, StreamOutput
from infer.serve.snapshot import SNAPSHOT_INTERVAL_S, EngineSnapshot, snapshot

# what a request's stream receives: a step's news (`as_output` makes it a StreamOutput), its last output, or
# the error that ended it
Item = News | StreamOutput | BaseException


class EngineStepError(InferError):
    """A step raised (a plugin's error): the requests in flight ended with it; the engine serves on."""

    exit_code = 1


class EngineDeadError(InferError):
    """The engine stopped (its process died, or its thread ended): what it held will not finish. The
    request was not at fault (a 503, never a 400): retry it once the engine is back."""

    exit_code = 1


class ShuttingDownError(InferError):
    """The server stops: a request it had not finished, or one that came too late (a 503: retry it elsewhere)."""

    exit_code = 1


class Sink(Protocol):
    """Where one request's items go; `put` runs on `loop`, in order."""

    loop: asyncio.AbstractEventLoop

    def put(self, item: Item) -> None: ...


@dataclass(slots=True)
class Add:
    request_id: str  # unique among unfinished requests (the front checks)
    prompt_token_ids: list[int]  # already tokenized and checked by the front
    prompt: str | None  # the text, for the final output
    params: SamplingParams  # already validated
    sink: Sink  # where its outputs go
    lora_request: LoRARequest | None = None  # its adapter, which the engine must serve already


@dataclass(slots=True)
class Abort:
    request_id: str  # ignored when the request already finished


@dataclass(slots=True)
class Call:
    fn: Callable[[Engine], Any]  # runs on the engine's thread, between steps
    future: Future  # gets fn's result or exception


class _Stop:
    pass


class EngineThread:
    def __init__(
        self,
        engine: Engine,
        name: str = "infer-engine",
        publish: Callable[[EngineSnapshot], None] | None = None,
        snapshot_interval_s: float = SNAPSHOT_INTERVAL_S,
    ) -> None:
        """publish: called on the engine's thread with each snapshot (it must not block for long)."""
        self.engine = engine
        self.snapshot_interval_s = snapshot_interval_s
        self._publish_to = publish
        self._published_at = 0.0  # time.monotonic() of the last snapshot
        self.snapshot = snapshot(engine)  # the latest: replaced whole, so any thread may read it
        self._inbox: queue.SimpleQueue[Add | Abort | Call | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # unfinished request id -> where its outputs go
        self._outbox: list[tuple[Sink, Item]] = []  # delivered after the step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, command: Add | Abort | Call) -> None:
        """From any thread: applied before the next step."""
        self._inbox.put(command)

    def stop(self, timeout: float | None = None) -> None:
        """End the thread after the commands already sent; unfinished requests get a RequestError."""
        self._inbox.put(_Stop())
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exitcode(self) -> int | None:
        """None: a thread has no exit code (`EngineProcess.exitcode` is its process's)."""
        return None

    # ------------------------------------------------------------------ on the engine's thread

    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._apply_commands(wait=not self.engine.has_unfinished())
                if running and self.engine.has_unfinished():
                    self._step()
            except Exception as exc:  # a step (or this loop) failed: its requests end, the thread serves on
                self._fail(exc)
            self._publish(idle=not self.engine.has_unfinished())
            self._flush()
        stopping = ShuttingDownError("the server is shutting down: retry the request on another server")
        self._end_all(stopping)
        while not self._inbox.empty():  # commands sent after the stop
            command = self._inbox.get()
            if isinstance(command, Add):
                self._outbox.append((command.sink, stopping))
            elif isinstance(command, Call):
                command.future.set_exception(stopping)
        self._flush()

    def _apply_commands(self, wait: bool) -> bool:
        """Apply every queued command (waiting for one when idle); False once asked to stop."""
        if not wait and self._inbox.empty():
            return True
        command = self._inbox.get()
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            if self._inbox.empty():
                return True
            command = self._inbox.get()

    def _apply(self, command: Add | Abort | Call) -> None:
        if isinstance(command, Call):
            if not command.future.set_running_or_notify_cancel():  # its caller gave up waiting
                return
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:
                command.future.set_exception(exc)
        elif isinstance(command, Abort):
            if command.request_id in self._sinks and self.engine.is_generating(command.request_id):
                self.engine.request_abort(command.request_id)
                self.engine.abort_pending()  # its blocks are free now; its output comes from the next step
        else:
            self._add(command)

    def _add(self, command: Add) -> None:
        prompt = {"prompt_token_ids": command.prompt_token_ids}
        try:
            request_id = self.engine.add_request(
                prompt, command.params, command.request_id, command.lora_request, load_adapter=False
            )
        except Exception as exc:  # this request alone is refused
            error = exc if isinstance(exc, InferError) else RequestError(f"this request could not be added ({exc})")
            self._outbox.append((command.sink, error))
            return
        self.engine.stream(request_id, command.prompt)
        self._sinks[request_id] = command.sink

    def _step(self) -> None:
        step = self.engine.step_outputs()
        for output, last in step.finished:
            sink = self._sinks.pop(output.request_id, None)
            if sink is not None:
                # refused after it was added (its constraint failed to compile, or in time): the error is its answer
                self._outbox.append((sink, RequestError(output.error) if output.error is not None else last))
        for request_id, deltas in step.news:
            self._outbox.append((self._sinks[request_id], (request_id, deltas)))

    def _fail(self, exc: Exception) -> None:
        """A step (or this thread's own work) raised: end every request (blocks freed, as Engine.generate
        does) and tell their streams."""
        error = EngineStepError(
            f"the engine failed in a step ({type(exc).__name__}: {one_line(exc)}): the requests in flight "
            f"ended; retry them, and report the error if it persists"
        )
        try:  # Engine.generate's recovery: runners idle, blocks free (if it fails, the thread ends: /health says so)
            self.engine.abandon_all()
        finally:
            self._end_all(error)

    def _end_all(self, error: Exception) -> None:
        sinks, self._sinks = self._sinks, {}
        self._outbox += [(sink, error) for sink in sinks.values()]

    def _publish(self, idle: bool) -> None:
        """A new snapshot when the last is `snapshot_interval_s` old, or the engine goes idle (each loop did
        something: a step, or commands that came while idle). Metrics never stop the serving: a failure
        here is logged and the last snapshot stays."""
        now = time.monotonic()
        if not idle and now - self._published_at < self.snapshot_interval_s:
            return
        try:
            self.snapshot = snapshot(self.engine)
            self._published_at = now
            if self._publish_to is not None:
                self._publish_to(self.snapshot)
        except Exception as exc:
            get_logger().warning("engine snapshot failed", error=f"{type(exc).__name__}: {one_line(exc)}")

    def _flush(self) -> None:
        """One call_soon_threadsafe per event loop (there is one, as a rule) for the whole step."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        hand_over(outbox)


def hand_over(items: list[tuple[Sink, Item]]) -> None:
    """From any thread: each item to its sink, one call_soon_threadsafe per event loop."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Sink, Item]]] = {}
    for sink, item in items:
        batches.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(put_all, batch)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def put_all(batch: list[tuple[Sink, Item]]) -> None:
    for sink, item in batch:
        sink.put(item)
