"""`AsyncEngine`: one Engine served to asyncio callers, each request a stream of per-step deltas.

    engine = Asyncmake_engine(EngineConfig(model="smollm2-135m"))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16, temperature=0)):
        print(out.deltas[0].text, end="")        # out.final, in the last one, is LLM.generate's output

The Engine runs in a thread of its own (`engine_thread`): this side checks and tokenizes a request,
hands it over, and reads what the thread delivers. A reader that stops early (`aclose`, a cancelled
task, an HTTP client gone) aborts its request: its KV blocks are freed before the next step.

When the engine is gone (its process died, its thread ended, or `close()`), its streams end and new
requests are refused with `EngineDeadError`: the request was not at fault. A spawned engine can be
built again in a fresh process (`restart`). A server that stops ends what is still open with its own
error at once (`end_all`), without waiting on the engine's thread (which may be mid-step).
`snapshot` is the engine's state as its thread last published it (for /metrics: no call, no wait).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, TypeVar

from infer.api.adapters import LoRARequest
from infer.api.errors import ConfigError, InferError, RequestError
from infer.api.request import SamplingParams
from infer.core.engine import Engine, Prompt
from infer.core.stream import StreamOutput, as_output, merge
from infer.runtime.builder import make_engine
from infer.serve.engine_thread import Abort, Add, Call, EngineDeadError, EngineThread, Item
from infer.serve.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from infer.serve.engine_process import EngineFront, EngineLink, EngineProcess, Starter

T = TypeVar("T")


class QueueFullError(InferError):
    """More requests wait for their first output than `max_waiting` allows."""


class RequestStream:
    """One request's outputs, in order (`async for out in stream`); the last has `finished` set.
    Closing it, or cancelling the task that reads it, before the last output aborts the request."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop  # the event loop that reads it: the engine's thread delivers there
        self.finished = False  # the last output (or the error that ended it) was read
        self._owner = owner
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._started = False  # something arrived: it no longer counts as waiting
        self._closed = False
        self._failed = False  # an error was put: it is the last item (what the engine sends after is dropped)

    def put(self, item: Item) -> None:
        """On the event loop, from the engine's thread (or `end_all`)."""
        self._mark_started()
        if not self._closed and not self._failed:
            self._failed = isinstance(item, BaseException)
            self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:  # the reader is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self._end()
            raise item
        item = as_output(item)
        while not item.finished and not self._queue.empty():  # behind: one output for the steps since
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._queue.put_nowait(later)  # the queue held only it: it is read next
                break
            item = merge(item, as_output(later))
        if item.finished:
            self._end()
        return item

    def close(self) -> None:
        """Stop reading; an unfinished request is aborted. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._mark_started()
        if not self.finished:
            self._owner._forget(self.request_id)
            self._owner._thread.send(Abort(self.request_id))

    async def aclose(self) -> None:
        self.close()

    def _end(self) -> None:
        self.finished = True
        self._owner._forget(self.request_id)

    def _mark_started(self) -> None:
        if not self._started:
            self._started = True
            self._owner.num_waiting -= 1


class AsyncEngine:
    """An Engine stepped by its own thread. Use it from one event loop (the server's)."""

    def __init__(
        self,
        engine: Engine | EngineFront,
        max_waiting: int | None = None,
        thread: EngineThread | EngineProcess | None = None,
        build: Callable[[], Engine] | None = None,
        start: "Starter | None" = None,
    ) -> None:
        """thread: what steps the engine (default: an `EngineThread` here; `spawn` passes an `EngineProcess`).
        build: what built it in its process (`spawn`'s): `restart` builds it again; start: how `spawn` started
        that process (`restart` starts the new one the same way)."""
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)):
            raise ConfigError(f"max_waiting={max_waiting!r}: use None (no limit) or an integer >= 0")
        if max_waiting is not None and max_waiting < 0:
            raise ConfigError(f"max_waiting={max_waiting}: use None (no limit) or an integer >= 0")
        self.engine = engine
        self.max_waiting = max_waiting  # requests accepted but without output yet, at most; None: no limit
        self.num_waiting = 0  # such requests now (changed on the event loop only)
        self.closed = False
        self._live: dict[str, RequestStream] = {}  # unfinished streams by request id
        self._ids = itertools.count()
        if thread is None:
            if not isinstance(engine, Engine):  # an EngineFront: its engine steps in another process
                raise ConfigError("an engine built in another process is stepped there: pass its EngineProcess")
            thread = EngineThread(engine)
        self._thread: EngineThread | EngineProcess = thread
        self._build = build  # what `spawn` was given: `restart` builds it again
        self._start = start  # and how it started the engine's process
        self._ended: BaseException | None = None  # set by end_all: every new request is refused with it
        self.num_restarts = 0  # times `restart` built it again
        self.restarting = False  # a restart is building it now

    @classmethod
    def from_config(
        cls, config: Any, extra_plugins: Iterable[Any] = (), max_waiting: int | None = None
    ) -> "AsyncEngine":
        """config: an EngineConfig (as `LLM` and `infer run` build one)."""
        from infer.distributed.launch import launch

        return cls(make_engine(config, extra_plugins, launch=launch), max_waiting)

    @classmethod
    def spawn(
        cls, build: Callable[[], Engine], max_waiting: int | None = None, start: "Starter | None" = None
    ) -> "AsyncEngine":
        """The engine that `build()` returns (picklable: e.g. `functools.partial(build_engine, config)`), built
        and stepped in a process of its own: what `infer serve` runs, so that the server's event loop never
        holds the GIL the step loop needs. `call` then takes module-level functions only. `start`: how that
        process is started (default: a child of this one; `infer.serve.ray_executor.RayStarter`: on Ray)."""
        from infer.serve.engine_process import EngineProcess

        process = EngineProcess(build, start=start)
        return cls(process.front, max_waiting, thread=process, build=build, start=start)

    @classmethod
    def attached(cls, link: "EngineLink", max_waiting: int | None = None) -> "AsyncEngine":
        """The engine behind `link` (`attach()` of a spawned engine, in another process): what an API server
        process of `--api-server-count` serves. Closing it ends the link (its unfinished requests aborted), not
        the engine; it cannot be restarted from here."""
        from infer.serve.engine_process import EngineProcess

        process = EngineProcess.attached(link)
        return cls(process.front, max_waiting, thread=process)

    def attach(self) -> "EngineLink":
        """A new connection to this spawned engine, for `attached` in another process (picklable for a spawned
        child, which takes it as an argument)."""
        from infer.serve.engine_process import EngineProcess

        if not isinstance(self._thread, EngineProcess):
            raise ConfigError("only an engine in a process of its own (AsyncEngine.spawn) can be attached to")
        self._check_alive()
        return self._thread.attach()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        """Whether the engine's thread runs (it ends only with close(), or if it crashed)."""
        return self._thread.is_alive

    @property
    def exitcode(self) -> int | None:
        """A spawned engine's process exit code once it ended (-9: SIGKILL); None while it runs, or in-thread."""
        return self._thread.exitcode

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state as its thread last published it (at most ~0.25 s old while it steps)."""
        return self._thread.snapshot

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Check and queue one request, on the event loop that will read its stream. A bad prompt or
        params raise RequestError here, a full queue QueueFullError, before anything runs. `lora_request`:
        an adapter the engine serves already (`add_adapter`); one it no longer serves fails the request."""
        loop = asyncio.get_running_loop()
        if self._ended is not None:
            raise self._ended
        self._check_alive()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        params.validate()
        vocab_size = self.engine.parts.vocab_size
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise RequestError(f"invalid logprobs={params.logprobs}: the vocabulary has {vocab_size} tokens")
        text, ids = self.engine.tokenize(prompt)
        request_id = self._new_id() if request_id is None else request_id
        if not isinstance(request_id, str) or request_id in self._live:
            raise RequestError(f"request id {request_id!r} is not a string or is in use: pick a unique string")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting to start, the most this server queues (max_waiting): "
                f"retry later"
            )
        stream = RequestStream(self, request_id, loop)
        self._live[request_id] = stream
        self.num_waiting += 1
        try:
            self._thread.send(Add(request_id, ids, text, params, stream, lora_request))
        except BaseException:  # it never reached the engine
            self._live.pop(request_id, None)
            self.num_waiting -= 1
            raise
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Each step's news for one request, the last with `final` set; bad input raises RequestError
        before the first. Leaving the loop early aborts the request."""
        stream = self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """End an unfinished request: its blocks are free when this returns, and its stream's last
        output has finish reason "abort"."""
        if request_id not in self._live:
            raise RequestError(f"no unfinished request has id {request_id!r}: check the id generate() was given")
        self._thread.send(Abort(request_id))
        await self.call(_nothing)  # commands apply in order: the abort is done

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine's thread between steps (to read its state safely)."""
        self._check_alive()
        future: Future[T] = Future()
        self._thread.send(Call(fn, future))
        return await asyncio.wrap_future(future)

    def end_all(self, error: BaseException) -> None:
        """End every open stream with `error` now (each reader gets it next), abort their requests, and refuse
        new ones with it: how a server that stops answers what it has not finished, even while the engine
        is in the middle of a long step."""
        self._ended = error
        for stream in list(self._live.values()):
            stream.put(error)
            self._forget(stream.request_id)
            try:
                self._thread.send(Abort(stream.request_id))
            except Exception:  # the engine is gone: nothing to abort
                pass

    async def restart(self) -> None:
        """Build a spawned engine again in a fresh process, after its process died (its streams have ended).
        Requests are refused with EngineDeadError until it is built; what building raises, this raises."""
        from infer.serve.engine_process import EngineProcess

        if self._build is None:
            raise ConfigError("only an engine made by AsyncEngine.spawn can be restarted")
        if self.closed or self.is_alive:
            raise ConfigError("restart a spawned engine only after its process died (and before close())")
        loop = asyncio.get_running_loop()
        self.restarting = True
        try:
            await loop.run_in_executor(None, self._thread.stop, 5.0)  # the dead process's pipe and reader
            process = await loop.run_in_executor(None, functools.partial(EngineProcess, self._build, start=self._start))
        finally:
            self.restarting = False
        if self.closed:  # closed while it was built
            process.stop()
            return
        self.engine, self._thread = process.front, process
        self.num_restarts += 1

    def close(self) -> None:
        """Stop the thread (unfinished requests end with a ShuttingDownError) and free the engine."""
        if self.closed:
            return
        self.closed = True
        self._thread.stop()
        self.engine.close()

    def _check_alive(self) -> None:
        if self.closed:
            raise EngineDeadError(
                "this engine was closed: the request did not run (embedding: build a new AsyncEngine)"
            )
        if not self.is_alive:
            code = self.exitcode
            how = f" (its process ended, exit code {code})" if code is not None else ""
            then = "it is being restarted: retry in a few seconds" if self.restarting else "retry it once it is back"
            raise EngineDeadError(f"the engine stopped{how}: the request did not run; {then}")

    def _new_id(self) -> str:
        while (request_id := f"req-{next(self._ids)}") in self._live:
            pass
        return request_id

    def _forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)


def _nothing(engine: Engine) -> None:
    """A call that only waits for the commands sent before it (module-level: it crosses to a process)."""


def build_engine(config: Any) -> Engine:
    """An Engine from an EngineConfig, its `--tp` ranks launched: what `spawn` builds by default."""
    from infer.distributed.launch import launch

    return make_engine(config, launch=launch)
