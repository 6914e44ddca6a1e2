"""`--api-server-count N`: N API server processes in front of the same engines, on one listening socket.

One event loop accepts, reads, parses and answers every HTTP request first come first served, before
any priority is known; past a few hundred requests a second it is the queue a high-priority request
waits in, however the engine schedules it (and at saturation its JSON work is what the GPU waits for).
With N fronts the kernel hands each new connection to one of N processes blocked in `accept` on the
same socket (uvicorn's `--workers` does the same), and each front reaches every engine over a
connection of its own (`AsyncEngine.attach`, `engine_child`): the engines are built once, by this
process, which then only supervises.

- **Signals.** This process takes SIGINT and SIGTERM and sends each front one SIGUSR1 per signal it
  gets: the first drains (`server.Server`), a second cuts, a third kills. Fronts ignore SIGINT and
  SIGTERM, which a terminal's Ctrl-C or a kill of the process group also sends them: each counts once.
- **A front that dies** (killed, out of memory) loses the connections it held, and its unfinished
  requests are aborted in the engines; the others serve on, and a new front is started in its place.
  A front that stops reading (hung, stopped) never stalls an engine: its messages queue on a thread of
  their own in the engine's process, and past `engine_child.MAX_PENDING` of them it is dropped (its
  requests aborted; it then ends, and a new one starts). A front that dies before it ever served stops
  the server (its error is a configuration's).
- **An engine that dies** ends every front's requests with 503s; each front shuts down as one server
  does (`EXIT_ENGINE_DIED`), and so does this process (`--restart-engine` is refused here: each front
  holds its own connections to an engine). With `--data-parallel-size`, a replica that dies is passed
  over by every front's router, and a front started after that routes over the live ones.
- **/metrics** answered by any front sums every front's request counters and histograms
  (prometheus_client's multiprocess mode, over a directory of this process's that it removes at the
  end, or the store's process does if this one was killed), beside the engines' own state as each front
  last received it. prometheus_client's multiprocess mode leaves out the `_created` samples.
- **`previous_response_id`** finds a response stored by any front: the store is a process of this
  server's own, reached through a `multiprocessing` manager (a blocking call of about 0.1 ms).
- `--max-waiting` holds per front: N fronts queue up to N times it, together.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.managers import BaseManager
from types import FrameType
from typing import Any, Mapping

from infer.api.errors import ConfigError
from infer.common import env, log
from infer.serve.async_engine import AsyncEngine
from infer.serve.engine_process import EngineLink
from infer.serve.engine_thread import EngineDeadError
from infer.serve.replicas import ReplicatedEngine
from infer.serve.responses import ResponseStore
from infer.serve.server import EXIT_CUT, EXIT_ENGINE_DIED, EXIT_OK

__all__ = ["serve_fronts"]

POLL_S = 0.2
logger = logging.getLogger("uvicorn.error")


class _StoreManager(BaseManager):
    pass


_StoreManager.register("ResponseStore", ResponseStore)


@dataclass(slots=True)
class FrontPlan:
    """What one front needs (crosses to its spawned process)."""

    index: int
    links: dict[str, EngineLink | list[EngineLink]]  # per served model: its engine, or its replicas
    app_options: dict[str, Any]  # create_app's keyword arguments, bar the engines, lifecycle and tracer
    uvicorn_options: dict[str, Any]  # uvicorn.Config's
    shutdown_timeout_s: float
    max_waiting: int | None
    metrics_dir: str
    store: Any  # a proxy of the shared ResponseStore
    otlp_traces_endpoint: str | None = None
    log_settings: tuple[bool, str] | None = None  # this process's (`infer.common.log.settings`)


def serve_fronts(
    count: int,
    engines: Mapping[str, AsyncEngine | ReplicatedEngine],
    app_options: dict[str, Any],
    uvicorn_options: dict[str, Any],
    shutdown_timeout_s: float,
    max_waiting: int | None = None,
    otlp_traces_endpoint: str | None = None,
) -> int:
    """Serve `engines` through `count` front processes on uvicorn_options' host and port until a signal or an
    engine's death; the exit code (`server`'s: the worst of the fronts')."""
    import uvicorn

    if count < 2:
        raise ConfigError(f"--api-server-count {count}: the fronts of one server are 2 or more")
    supervisor = _Supervisor(count, engines)
    previous = {s: signal.signal(s, supervisor.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sock = metrics_dir = manager = None
    try:
        sock = uvicorn.Config("infer:LLM", **uvicorn_options).bind_socket()  # exit code 3 when it cannot bind
        metrics_dir = tempfile.mkdtemp(prefix="infer-metrics-")
        env.export("PROMETHEUS_MULTIPROC_DIR", metrics_dir)  # the fronts' prometheus_client counts in its files
        manager = _StoreManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_store_process, (metrics_dir,))
        store = manager.ResponseStore()  # type: ignore[attr-defined]

        def plan(index: int) -> FrontPlan:
            links = {name: engine.attach() for name, engine in engines.items()}
            return FrontPlan(
                index, links, app_options, uvicorn_options, shutdown_timeout_s, max_waiting, metrics_dir, store,
                otlp_traces_endpoint, log.settings(),
            )  # fmt: skip

        return supervisor.run(plan, sock)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if sock is not None:
            sock.close()
        if manager is not None:
            manager.shutdown()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _store_process(metrics_dir: str) -> None:
    """The store's process outlives the signals (the fronts drain, and store, after them; its end is `shutdown`),
    but not the server's process: killed with -9, that one can neither shut it down nor remove `metrics_dir`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="infer-store-parent", daemon=True).start()


class _Supervisor:
    def __init__(self, count: int, engines: Mapping[str, Any]) -> None:
        self.engines = engines  # this process's own connections: whether the engines live
        self.context = multiprocessing.get_context("spawn")
        self.fronts: list[Any] = [None] * count  # per front: (process, ready event, [signals told]); None: ended
        self.codes: list[int] = []
        self.signals = 0  # SIGINT/SIGTERM received
        self.stopping = False

    def run(self, plan: Any, sock: socket.socket) -> int:
        self.plan, self.sock = plan, sock
        try:
            for i in range(len(self.fronts)):
                if not self.stopping:  # a signal while they start: those started are told, no more start
                    self._start(i)
            while any(f is not None for f in self.fronts):
                time.sleep(POLL_S)
                self._look()
        finally:
            for front in self.fronts:  # interrupted itself: no front outlives it (they ignore SIGTERM)
                if front is not None and front[0].is_alive():
                    front[0].kill()
        if EXIT_ENGINE_DIED in self.codes:
            return EXIT_ENGINE_DIED
        if EXIT_CUT in self.codes:
            return EXIT_CUT
        return max(self.codes, default=EXIT_OK)

    def _start(self, index: int) -> None:
        plan = self.plan(index)
        ready = self.context.Event()
        process = self.context.Process(target=_front_main, args=(plan, self.sock, ready), name=f"infer-api-{index}")
        process.start()
        for links in plan.links.values():  # the child holds its duplicates
            for link in links if isinstance(links, list) else [links]:
                link.conn.close()
        self.fronts[index] = (process, ready, [0])  # [signals passed on to it]
        self._catch_up(self.fronts[index])  # a signal that came while it started

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        self.stopping = True
        for front in self.fronts:
            if front is not None:
                self._catch_up(front)

    def _catch_up(self, front: tuple[Any, Any, list[int]]) -> None:
        """Pass on the signals `front` has not had: SIGUSR1, a front's signal to drain (a second: to cut); past
        two, SIGKILL."""
        process, _, told = front
        try:
            if self.signals > 2:
                process.kill()
            while told[0] < min(self.signals, 2) and process.is_alive():
                told[0] += 1
                os.kill(process.pid, signal.SIGUSR1)
        except (ProcessLookupError, ValueError):  # it ended meanwhile
            pass

    def _look(self) -> None:
        for i, front in enumerate(self.fronts):
            if front is None or front[0].is_alive():
                continue
            process, ready, _ = front
            code = process.exitcode
            self.fronts[i] = None
            if self.stopping:  # told to stop: killed by the signal before its handler was in, it had nothing open
                self.codes.append(code if code is not None and code >= 0 else EXIT_OK)
                continue
            engines_live = all(engine.is_alive for engine in self.engines.values())
            if not ready.is_set() or (code == EXIT_ENGINE_DIED and not engines_live):
                if not ready.is_set() and code != EXIT_ENGINE_DIED:
                    logger.error("API server %d exited before it served (exit code %s): stopping", i, code)
                self.codes.append(code if code is not None and code >= 0 else 1)
                self.stopping = True  # an engine died, or a front could not start: the others stop too
                self.signals = max(self.signals, 1)
                for other in self.fronts:
                    if other is not None:
                        self._catch_up(other)
                continue
            how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
            logger.error("API server %d ended (%s): its connections are lost; starting it again", i, how)
            try:
                self._start(i)
            except EngineDeadError:  # its engine died meanwhile: the others find it too
                self.codes.append(EXIT_ENGINE_DIED)


def _front_server(config: Any, engines: Any, lifecycle: Any, shutdown_timeout_s: float, ready: Any) -> Any:
    """`server.Server` for a front (made in the front's process, where uvicorn is imported)."""
    from infer.serve.server import Server

    class FrontServer(Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """SIGINT and SIGTERM reach a front from a terminal or a kill of the process group too: only the
            supervisor's SIGUSR1, one per signal it got, counts."""
            if sig == signal.SIGUSR1:
                super().handle_exit(signal.SIGTERM, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

    server = FrontServer(config, engines, lifecycle, shutdown_timeout_s)
    signal.signal(signal.SIGUSR1, server.handle_exit)  # uvicorn's own handlers take SIGINT and SIGTERM only
    return server


def _front_main(plan: FrontPlan, sock: socket.socket, ready: Any) -> None:
    """A front's process: its engines' links, its app and its uvicorn on the shared socket."""
    # only the supervisor's SIGUSR1 stops a front: not a Ctrl-C to the process group while it starts or ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import uvicorn

    from infer.serve.app import create_app
    from infer.serve.lifecycle import Lifecycle

    if plan.log_settings is not None:
        log.configure(*plan.log_settings)
    engines: dict[str, Any] = {}
    for name, links in plan.links.items():
        if isinstance(links, list):
            engines[name] = ReplicatedEngine.attached(links, plan.max_waiting)
        else:
            engines[name] = AsyncEngine.attached(links, plan.max_waiting)
    tracer = None
    if plan.otlp_traces_endpoint is not None:
        from infer.serve.tracing import otlp_tracer

        tracer = otlp_tracer(plan.otlp_traces_endpoint)
    lifecycle = Lifecycle()
    app = create_app(
        engines,
        tracer=tracer,
        lifecycle=lifecycle,
        metrics_dir=plan.metrics_dir,
        response_store=plan.store,
        **plan.app_options,
    )
    server = _front_server(
        uvicorn.Config(app, **plan.uvicorn_options), engines, lifecycle, plan.shutdown_timeout_s, ready
    )
    try:
        server.run(sockets=[sock])
    finally:
        for engine in engines.values():
            engine.close()
    sys.exit(server.exit_code)
